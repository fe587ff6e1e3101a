//! Stop strings matched on streamed text across token boundaries.
//!
//! A generated token decodes to a piece of text that may hold a whole stop
//! string, a part of one, or the end of one begun pieces ago. [`StopMatcher`]
//! is fed the pieces as they stream (the output of
//! [`TextStream::push`](crate::TextStream::push)), holds back text that could
//! still be the start of a stop string, and hands out only text that can no
//! longer be part of one. Once a stop string is complete, it returns the text
//! that ends before it and reports which stop string matched.

use crate::error::{Error, Result};

/// Finds stop strings in text that arrives in pieces.
///
/// The match is the stop string occurrence that *ends* first in the text
/// (among those ending at the same place, the longest): generation stops as
/// soon as any stop string is complete, so the result never depends on how
/// the text was split into pieces.
///
/// ```
/// use qwen3_wgpu::StopMatcher;
/// let mut stops = StopMatcher::new(["\nUser:"])?;
/// let mut shown = String::new();
/// for piece in ["Sure, here", " it is.\n", "Us", "er: more"] {
///     let step = stops.push(piece);
///     shown += &step.text;
///     if step.stopped.is_some() {
///         break;
///     }
/// }
/// assert_eq!(shown, "Sure, here it is.");
/// # Ok::<(), qwen3_wgpu::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct StopMatcher {
    stops: Vec<String>,
    /// Text received but not yet handed out: a suffix that is a proper
    /// prefix of some stop string.
    held: String,
    /// Index (into `stops`) of the stop string found, once one is.
    stopped: Option<usize>,
}

/// What one [`StopMatcher::push`] hands out.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct StopStep {
    /// Text that is final: it precedes any stop string (possibly empty while
    /// text is held back).
    pub text: String,
    /// Index of the stop string (in the order given to
    /// [`StopMatcher::new`]) that completed in this piece; the text after it
    /// is dropped.
    pub stopped: Option<usize>,
}

impl StopMatcher {
    /// A matcher for `stops`.
    ///
    /// Errors: [`Error::InvalidArgument`] (`stop`) for an empty stop string,
    /// which would match before any text.
    pub fn new<I, S>(stops: I) -> Result<Self>
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        let stops: Vec<String> = stops.into_iter().map(Into::into).collect();
        if stops.iter().any(String::is_empty) {
            return Err(Error::invalid_argument("stop", "a stop string must not be empty"));
        }
        Ok(Self { stops, held: String::new(), stopped: None })
    }

    /// The stop strings, in the order given.
    pub fn stops(&self) -> &[String] {
        &self.stops
    }

    /// The index of the stop string found, if one was.
    pub fn stopped(&self) -> Option<usize> {
        self.stopped
    }

    /// The text held back so far: it could still be the start of a stop
    /// string.
    pub fn held(&self) -> &str {
        &self.held
    }

    /// Feeds the next piece of text. Returns the text that is now final and,
    /// when a stop string completed, its index. After a stop, further pieces
    /// are ignored (an empty step with the same index is returned).
    pub fn push(&mut self, piece: &str) -> StopStep {
        if let Some(index) = self.stopped {
            return StopStep { text: String::new(), stopped: Some(index) };
        }
        // The held text contains no complete stop string, so only matches
        // that end inside `piece` are new; scanning from the held text's
        // start keeps the code simple and the held text is short.
        self.held.push_str(piece);
        let buffer = std::mem::take(&mut self.held);
        if let Some((start, index)) = self.first_match(&buffer, buffer.len() - piece.len()) {
            self.stopped = Some(index);
            let mut text = buffer;
            text.truncate(start);
            return StopStep { text, stopped: Some(index) };
        }
        let keep_from = self.partial_start(&buffer);
        self.held = buffer[keep_from..].to_string();
        let mut text = buffer;
        text.truncate(keep_from);
        StopStep { text, stopped: None }
    }

    /// Ends the text (generation stopped for another reason): returns the
    /// text still held back, which no stop string can now complete. Empty
    /// after a stop string matched.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }

    /// The first stop string occurrence in `text` that ends after byte
    /// `new_from` (earliest end; the longest of those ending together), as
    /// (start byte, stop index).
    fn first_match(&self, text: &str, new_from: usize) -> Option<(usize, usize)> {
        let ends = text.char_indices().map(|(i, c)| i + c.len_utf8()).filter(|&end| end > new_from);
        for end in ends {
            let best = self
                .stops
                .iter()
                .enumerate()
                .filter(|(_, stop)| text[..end].ends_with(stop.as_str()))
                .max_by_key(|(i, stop)| (stop.len(), std::cmp::Reverse(*i)));
            if let Some((index, stop)) = best {
                return Some((end - stop.len(), index));
            }
        }
        None
    }

    /// The start of the longest suffix of `text` that is a proper prefix of
    /// a stop string (`text.len()` when there is none).
    fn partial_start(&self, text: &str) -> usize {
        // A tail as long as the longest stop string cannot be a proper prefix.
        let longest = self.stops.iter().map(String::len).max().unwrap_or(0);
        text.char_indices()
            .map(|(i, _)| i)
            .filter(|&i| text.len() - i < longest)
            .find(|&i| {
                let tail = &text[i..];
                self.stops.iter().any(|stop| stop.len() > tail.len() && stop.starts_with(tail))
            })
            .unwrap_or(text.len())
    }
}
