//! Telling the template's own special tokens from the data's in a rendered
//! conversation, for `ChatTemplate::encode`.

use std::collections::HashSet;
use std::ops::Range;

use serde_json::Value as Json;

use super::message::{ChatOptions, Message};
use super::template::ChatTemplate;

impl ChatTemplate {
    /// The spans of `text` (the rendered conversation) that hold the
    /// template's own special tokens; `None` when they cannot be told.
    pub(super) fn template_specials(
        &self,
        text: &str,
        messages: &[Message],
        options: &ChatOptions,
        specials: &Specials,
    ) -> Option<Vec<Range<usize>>> {
        if options.continue_final_message {
            // The text is the whole render cut short (possibly after the
            // template's end of turn): the spans are the whole render's
            // that the cut keeps.
            let whole_options = ChatOptions { continue_final_message: false, ..options.clone() };
            let whole = self.render(messages, &whole_options).ok()?;
            let mut spans = whole
                .starts_with(text)
                .then(|| self.template_specials(&whole, messages, &whole_options, specials))??;
            spans.retain(|span| span.end <= text.len());
            return Some(spans);
        }
        self.template_specials_by_hiding(text, messages, options, specials)
            .or_else(|| self.template_specials_by_marking(text, messages, options, specials))
    }

    /// The spans of `text` (the rendered conversation) that hold the
    /// template's own special tokens, found by rendering with the data's
    /// special-token strings hidden; `None` when that render, revealed, is
    /// not `text` (the template transformed a hidden token).
    fn template_specials_by_hiding(
        &self,
        text: &str,
        messages: &[Message],
        options: &ChatOptions,
        specials: &Specials,
    ) -> Option<Vec<Range<usize>>> {
        let hidden =
            self.render_with(&self.env, messages, options, &|s| specials.hide(s), &str::to_owned).ok()?;
        let (revealed, spans) = specials.restore(&hidden, ESCAPE, Coded::Data);
        (revealed == text).then_some(spans)
    }

    /// As [`template_specials_by_hiding`](Self::template_specials_by_hiding),
    /// but with the data as it is and the template's own special-token
    /// strings (in its source and the special-token variables) marked with a
    /// character the data and the source do not hold; `None` when that
    /// render, unmarked, is not `text` (the template compares the data with
    /// its control tokens, say).
    fn template_specials_by_marking(
        &self,
        text: &str,
        messages: &[Message],
        options: &ChatOptions,
        specials: &Specials,
    ) -> Option<Vec<Range<usize>>> {
        let mut sources = Vec::with_capacity(self.names.len());
        for name in &self.names {
            sources.push((name.clone(), self.env.get_template(name).ok()?.source().to_owned()));
        }
        let first_free = FIRST_CODE + specials.len() as u32;
        let mut used = HashSet::new();
        let mut note = |s: &str| used.extend(s.chars().filter(|&c| c as u32 >= first_free));
        visit_data_strings(messages, options, &mut note);
        sources.iter().for_each(|(_, source)| note(source));
        self.special_tokens.values().for_each(|v| visit_strings(v, &mut note));
        let marker =
            (first_free..=ESCAPE as u32).rev().filter_map(char::from_u32).find(|c| !used.contains(c))?;
        let mut env = self.env.clone();
        for (name, source) in sources {
            env.add_template_owned(name, specials.mark(&source, marker)).ok()?;
        }
        let marked =
            self.render_with(&env, messages, options, &str::to_owned, &|s| specials.mark(s, marker)).ok()?;
        let (unmarked, spans) = specials.restore(&marked, marker, Coded::Template);
        (unmarked == text).then_some(spans)
    }
}

/// Calls `f` on every string (and object key) of the caller's data: the
/// messages, the tools and the variables, as `render_with` maps them.
pub(super) fn visit_data_strings(messages: &[Message], options: &ChatOptions, f: &mut dyn FnMut(&str)) {
    for message in messages {
        visit_strings(&serde_json::to_value(message).expect("messages serialize"), f);
    }
    options.tools.iter().for_each(|tool| visit_strings(tool, f));
    options.variables.values().for_each(|value| visit_strings(value, f));
}

fn visit_strings(json: &Json, f: &mut dyn FnMut(&str)) {
    match json {
        Json::String(s) => f(s),
        Json::Array(items) => items.iter().for_each(|v| visit_strings(v, f)),
        Json::Object(o) => o.iter().for_each(|(k, v)| {
            f(k);
            visit_strings(v, f)
        }),
        Json::Null | Json::Bool(_) | Json::Number(_) => {}
    }
}

/// The tokenizer's special-token strings, and the private-use codes that
/// stand for them while `ChatTemplate::encode` finds which control tokens
/// of the rendered text are the template's. Special token `k` is coded as
/// a prefix character followed by `U+F0000 + k`: [`ESCAPE`] for the data's
/// tokens (hidden; a literal [`ESCAPE`] in the data is doubled, so hiding
/// is reversible whatever the data holds), or a marker the data and the
/// template do not hold for the template's own.
pub(super) struct Specials {
    tokens: Vec<String>,
    /// Whether a token starts with this byte: most text positions start
    /// none, and are skipped without comparing every token.
    first_bytes: [bool; 256],
}

/// A private-use character (plane 16) no tokenizer gives meaning to.
pub(super) const ESCAPE: char = '\u{10FFFD}';
const FIRST_CODE: u32 = 0xF0000;
/// Special tokens [`Specials`] can code: one code each from [`FIRST_CODE`]
/// up to [`ESCAPE`] (a tokenizer file could name more; that is an error).
pub(super) const MAX_CODED_SPECIALS: usize = (ESCAPE as u32 - FIRST_CODE) as usize;

/// Which special tokens a coded text codes, and so which are the template's.
#[derive(Clone, Copy, PartialEq)]
pub(super) enum Coded {
    /// The data's (hidden): the tokens written out are the template's.
    Data,
    /// The template's (marked): the tokens written out are the data's.
    Template,
}

impl Specials {
    pub(super) fn new(mut tokens: Vec<String>) -> Self {
        tokens.retain(|s| !s.is_empty());
        let mut first_bytes = [false; 256];
        for token in &tokens {
            first_bytes[token.as_bytes()[0] as usize] = true;
        }
        Self { tokens, first_bytes }
    }

    pub(super) fn len(&self) -> usize {
        self.tokens.len()
    }

    /// The special token that starts `text`, the longest when several do
    /// (as the tokenizer matches), with its index.
    fn at(&self, text: &str) -> Option<(usize, &str)> {
        if !self.first_bytes[*text.as_bytes().first()? as usize] {
            return None;
        }
        self.tokens
            .iter()
            .enumerate()
            .filter(|(_, s)| text.starts_with(s.as_str()))
            .max_by_key(|(_, s)| s.len())
            .map(|(i, s)| (i, s.as_str()))
    }

    /// The first special-token string in `text`.
    pub(super) fn first_in(&self, text: &str) -> Option<&str> {
        text.char_indices().find_map(|(i, _)| self.at(&text[i..])).map(|(_, s)| s)
    }

    fn code(index: usize) -> char {
        char::from_u32(FIRST_CODE + index as u32).expect("at most MAX_CODED_SPECIALS, checked in encode")
    }

    /// The special token `code` stands for.
    fn coded(&self, code: char) -> Option<&str> {
        self.tokens.get((code as u32).wrapping_sub(FIRST_CODE) as usize).map(String::as_str)
    }

    /// `text` (the data) with its special tokens hidden: coded after
    /// [`ESCAPE`].
    pub(super) fn hide(&self, text: &str) -> String {
        self.code_all(text, ESCAPE, true)
    }

    /// `text` (the template's source or variables) with its special tokens
    /// coded after `marker`.
    pub(super) fn mark(&self, text: &str, marker: char) -> String {
        self.code_all(text, marker, false)
    }

    fn code_all(&self, text: &str, prefix: char, double_prefix: bool) -> String {
        let mut out = String::with_capacity(text.len());
        let mut rest = text;
        while let Some(c) = rest.chars().next() {
            if let Some((index, special)) = self.at(rest) {
                out.push(prefix);
                out.push(Self::code(index));
                rest = &rest[special.len()..];
                continue;
            }
            if double_prefix && c == prefix {
                out.push(prefix);
            }
            out.push(c);
            rest = &rest[c.len_utf8()..];
        }
        out
    }

    /// Undoes [`hide`](Self::hide) (`Coded::Data`, `prefix` [`ESCAPE`]) or
    /// [`mark`](Self::mark) (`Coded::Template`) on a rendered text: the text
    /// with every code back to its token, and the byte spans in it of the
    /// template's special tokens (the ones written out, or the coded ones).
    /// A prefix starting no code (the template cut a code apart) is kept,
    /// so the result no longer equals the real render.
    pub(super) fn restore(&self, text: &str, prefix: char, coded: Coded) -> (String, Vec<Range<usize>>) {
        let mut out = String::with_capacity(text.len());
        let mut spans = Vec::new();
        let mut rest = text;
        while let Some(c) = rest.chars().next() {
            if c == prefix {
                let after = &rest[c.len_utf8()..];
                let next = after.chars().next();
                if coded == Coded::Data && next == Some(prefix) {
                    out.push(prefix);
                    rest = &after[prefix.len_utf8()..];
                    continue;
                }
                if let Some((code, special)) = next.and_then(|code| Some((code, self.coded(code)?))) {
                    let start = out.len();
                    out.push_str(special);
                    if coded == Coded::Template {
                        spans.push(start..out.len());
                    }
                    rest = &after[code.len_utf8()..];
                    continue;
                }
            } else if coded == Coded::Data {
                if let Some((_, special)) = self.at(rest) {
                    spans.push(out.len()..out.len() + special.len());
                    out.push_str(special);
                    rest = &rest[special.len()..];
                    continue;
                }
            }
            out.push(c);
            rest = &rest[c.len_utf8()..];
        }
        (out, spans)
    }
}
