//! One reply's constraint: llguidance's matcher, the tokens it allows
//! next as a GPU mask, and whether the grammar is complete.

use std::sync::{mpsc, Arc};

use llguidance::{Matcher, TokenParser};

use super::ConstraintVocabulary;
use crate::error::{Error, Result};

/// What [`ConstraintState::consume_token`] left to do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Consumed {
    /// Still waiting for the trigger: every token allowed.
    Dormant,
    /// The token was the trigger: the constraint's first mask holds.
    Woke,
    /// The mask after the token is known (only end-of-text follows).
    MaskReady,
    /// The mask after the token is still to be computed.
    MaskDue,
}

/// The parser state of one constrained reply.
pub(crate) struct ConstraintState {
    /// The constraint, to start over from.
    source: super::Constraint,
    kind: &'static str,
    matcher: Matcher,
    vocabulary: Arc<ConstraintVocabulary>,
    /// The mask of the tokens allowed next (llguidance's bit layout).
    mask: Vec<u32>,
    /// Waiting for the constraint's trigger token: every token allowed.
    dormant: bool,
    /// No token consumed since the start: starting over changes nothing.
    fresh: bool,
    /// The next reply's state, made on rayon's threads once this reply is
    /// complete (a restart on the caller's thread costs a parser's copy
    /// and its first mask, ~0.1-0.3 ms).
    next: Option<mpsc::Receiver<Result<ConstraintState>>>,
    /// Fast-forward below this token id (0: off): the tokens the grammar
    /// forces after a chosen token are consumed with it, as long as each
    /// is a logit of the model's (below its vocabulary).
    fast_forward_below: usize,
    /// The tokens forced after the last token consumed, not yet taken by
    /// the session ([`Self::take_forced`]); the mask follows them.
    forced: Vec<u32>,
}

impl ConstraintState {
    pub(super) fn new(
        source: super::Constraint,
        parser: TokenParser,
        vocabulary: Arc<ConstraintVocabulary>,
    ) -> Result<Self> {
        let kind = source.kind();
        let dormant = source.trigger().is_some();
        let mut state = Self {
            source,
            kind,
            matcher: Matcher::new(Ok(parser)),
            vocabulary,
            mask: Vec::new(),
            dormant,
            fresh: true,
            next: None,
            fast_forward_below: 0,
            forced: Vec::new(),
        };
        // Nothing is fast-forwarded at the start: the reply's first token
        // is the prompt's choice.
        state.compute_allowed()?;
        Ok(state)
    }

    /// The same constraint from its start (a new reply): the one made
    /// ahead if it is ready.
    pub(crate) fn restarted(&mut self) -> Result<Self> {
        let mut state = match self.next.take().map(|next| next.try_recv()) {
            Some(Ok(state)) => state?,
            _ => self.source.start()?,
        };
        state.fast_forward_below = self.fast_forward_below;
        Ok(state)
    }

    /// Fast-forwards the tokens the grammar forces, each below
    /// `vocab_size` (0: never; a session reporting log-probabilities
    /// steps every token).
    pub(crate) fn set_fast_forward(&mut self, vocab_size: usize) {
        self.fast_forward_below = vocab_size;
    }

    /// The tokens forced after the last token consumed (consumed already:
    /// the mask is the one after them), handed over once.
    pub(crate) fn take_forced(&mut self) -> Vec<u32> {
        std::mem::take(&mut self.forced)
    }

    /// Whether tokens were forced after the last token consumed (the
    /// choice after them follows their prompt batch, not this step).
    pub(crate) fn has_forced(&self) -> bool {
        !self.forced.is_empty()
    }

    /// Starts making the next reply's state on rayon's threads.
    fn prepare_restart(&mut self) {
        let source = self.source.clone();
        let (tx, next) = mpsc::sync_channel(1);
        rayon::spawn(move || {
            let _ = tx.send(source.start());
        });
        self.next = Some(next);
    }

    /// True while no token was consumed since the start (a restart would
    /// give the same state and mask).
    pub(crate) fn is_fresh(&self) -> bool {
        self.fresh
    }

    /// The mask of the tokens allowed next over a vocabulary of
    /// `vocab_size` logits (ids past the tokenizer's are never allowed).
    pub(crate) fn mask_words(&self, vocab_size: usize) -> Vec<u32> {
        let mut words = vec![0u32; crate::kernels::mask::words(vocab_size as u32)];
        if self.dormant {
            words.fill(u32::MAX);
        } else {
            let n = words.len().min(self.mask.len());
            words[..n].copy_from_slice(&self.mask[..n]);
        }
        // Clear bits past the vocabulary of the logits.
        if !vocab_size.is_multiple_of(32) {
            if let Some(last) = words.last_mut() {
                *last &= (1u32 << (vocab_size % 32)) - 1;
            }
        }
        words
    }

    /// Whether `token` is allowed next.
    pub(crate) fn allows(&self, token: u32) -> bool {
        if self.dormant {
            return true;
        }
        let t = token as usize;
        self.mask.get(t / 32).is_some_and(|w| w & (1 << (t % 32)) != 0)
    }

    /// Whether a token below `vocab_size` (a logit of the model's) is
    /// allowed next: not when only ids past the model's vocabulary are,
    /// e.g. a tokenizer's end-of-text beyond a smaller model's logits.
    pub(crate) fn allows_any_below(&self, vocab_size: usize) -> bool {
        if self.dormant {
            return true;
        }
        let whole = vocab_size / 32;
        self.mask.iter().take(whole).any(|&w| w != 0)
            || (!vocab_size.is_multiple_of(32)
                && self.mask.get(whole).is_some_and(|&w| w & ((1u32 << (vocab_size % 32)) - 1) != 0))
    }

    /// The constraint's kind, for errors.
    pub(crate) fn kind(&self) -> &'static str {
        self.kind
    }

    /// True while the constraint waits for its trigger token (every token
    /// allowed).
    pub(crate) fn is_dormant(&self) -> bool {
        self.dormant
    }

    /// Advances past `token` (chosen under the current mask) and computes
    /// the next mask. True when `token` was the trigger that wakes a
    /// dormant constraint (the tokens after it are constrained).
    pub(crate) fn consume(&mut self, token: u32) -> Result<bool> {
        let consumed = self.consume_token(token)?;
        if consumed == Consumed::MaskDue {
            self.compute_mask()?;
        }
        Ok(consumed == Consumed::Woke)
    }

    /// The cheap half of [`Self::consume`]: the parser past `token`,
    /// without the next mask when that is a parser's computation
    /// ([`Consumed::MaskDue`]: then [`Self::compute_mask`] before the
    /// mask is used).
    pub(crate) fn consume_token(&mut self, token: u32) -> Result<Consumed> {
        self.fresh = false;
        if self.dormant {
            self.dormant = self.source.trigger() != Some(token);
            return Ok(if self.dormant { Consumed::Dormant } else { Consumed::Woke });
        }
        if !self.allows(token) {
            return Err(Error::internal(format!(
                "token {token} was chosen although the {} constraint forbids it",
                self.kind
            )));
        }
        if self.matcher.is_stopped() {
            // End-of-text after a complete match: nothing changes.
            return Ok(Consumed::MaskReady);
        }
        self.matcher.consume_token(token).map_err(|e| self.failed(e))?;
        if self.matcher.is_stopped() {
            self.only_end_of_text();
            return Ok(Consumed::MaskReady);
        }
        Ok(Consumed::MaskDue)
    }

    /// A stopped parser computes no mask: only end-of-text follows, and
    /// the next reply's state is made ahead.
    fn only_end_of_text(&mut self) {
        self.mask.fill(0);
        for &t in &self.vocabulary.eos {
            if let Some(w) = self.mask.get_mut(t as usize / 32) {
                *w |= 1 << (t % 32);
            }
        }
        self.prepare_restart();
    }

    /// True once the grammar is complete: nothing but end-of-text may
    /// follow (or the parser stopped, after an end-of-text token).
    pub(crate) fn is_complete(&self) -> bool {
        if self.dormant {
            return false;
        }
        if self.matcher.is_stopped() {
            return true;
        }
        let eos = self.vocabulary.eos.as_slice();
        let mut any = false;
        for (w, &word) in self.mask.iter().enumerate() {
            let mut bits = word;
            while bits != 0 {
                let t = (w * 32) as u32 + bits.trailing_zeros();
                if !eos.contains(&t) {
                    return false;
                }
                any = true;
                bits &= bits - 1;
            }
        }
        any
    }

    /// Computes the mask of the tokens allowed next (up to milliseconds
    /// inside a free JSON string over a 150k vocabulary), after consuming
    /// the tokens the grammar forces when fast-forward is on (llguidance's
    /// canonical tokens of the forced bytes; the first one past the
    /// model's vocabulary ends them, the mask spelling the rest).
    pub(crate) fn compute_mask(&mut self) -> Result<()> {
        if self.fast_forward_below > 0 && !self.dormant && !self.matcher.is_stopped() {
            let bytes = self.matcher.compute_ff_bytes();
            if !bytes.is_empty() {
                let mut forced = self.vocabulary.forced_tokens(&bytes);
                if let Some(past) = forced.iter().position(|&t| t as usize >= self.fast_forward_below) {
                    forced.truncate(past);
                }
                // (The matcher takes what it accepts: all, as they spell
                // forced bytes.)
                let taken = self.matcher.try_consume_tokens(&forced).map_err(|e| self.failed(e))?;
                forced.truncate(taken);
                self.forced.extend(forced);
                if self.matcher.is_stopped() {
                    self.only_end_of_text();
                    return Ok(());
                }
            }
        }
        self.compute_allowed()
    }

    /// The mask of the tokens allowed next, from the parser as it is.
    fn compute_allowed(&mut self) -> Result<()> {
        let mask = self.matcher.compute_mask().map_err(|e| self.failed(e))?;
        self.mask = mask.as_slice().to_vec();
        if self.mask.iter().all(|&w| w == 0) {
            return Err(Error::invalid_argument(self.kind, "the constraint allows no token here"));
        }
        Ok(())
    }

    fn failed(&self, e: impl std::fmt::Display) -> Error {
        Error::invalid_argument(self.kind, format!("the constraint's parser failed: {e}"))
    }
}
