//! The checkpoint's tokenizer (`tokenizer.json`), and a streaming decoder
//! that only ever hands out complete UTF-8 text.

use std::any::Any;
use std::path::Path;
use std::sync::{Arc, OnceLock};

use crate::checked_read;
use crate::error::{Error, Result};

/// A Hugging Face tokenizer loaded from `tokenizer.json`.
///
/// Cloning is cheap (the vocabulary is shared), so a [`TextStream`] or a
/// game object can keep its own handle.
#[derive(Clone)]
pub struct Tokenizer {
    inner: Arc<tokenizers::Tokenizer>,
    /// A copy of `inner` that encodes special-token strings as plain text,
    /// built on first use: most texts contain none and never need it.
    specials_as_text: Arc<OnceLock<tokenizers::Tokenizer>>,
    /// What constraints derive from the vocabulary (their token trie),
    /// built on first use, or why it cannot be; typed by its one user
    /// ([`Tokenizer::derived`]) so this module needs nothing of it.
    derived: Arc<OnceLock<std::result::Result<Arc<dyn Any + Send + Sync>, String>>>,
    /// Where it was loaded from, for error messages.
    path: Arc<Path>,
}

impl Tokenizer {
    /// Largest `tokenizer.json` read, in bytes (256 MiB). Qwen3's is about
    /// 11 MB and the largest published vocabularies are under 40 MB.
    pub const MAX_FILE_LEN: u64 = checked_read::MAX_TOKENIZER_FILE_LEN;

    /// Loads `dir/tokenizer.json`.
    ///
    /// Errors: [`Error::CheckpointNotFound`] when the file (or `dir`) is
    /// missing; [`Error::CheckpointInvalid`] when it cannot be read or parsed.
    pub fn from_checkpoint(dir: &Path) -> Result<Self> {
        // Name the real problem when the whole directory is missing.
        if !dir.is_dir() {
            return Err(Error::CheckpointNotFound {
                path: dir.to_path_buf(),
                reason: "checkpoint directory does not exist".into(),
            });
        }
        Self::from_file(&dir.join("tokenizer.json"))
    }

    /// Loads a `tokenizer.json` file; errors as
    /// [`from_checkpoint`](Self::from_checkpoint). The file must be a
    /// regular file (symbolic links followed) of at most
    /// [`MAX_FILE_LEN`](Self::MAX_FILE_LEN) bytes; anything else (a FIFO, a
    /// device, a directory, a larger file) is [`Error::CheckpointInvalid`]
    /// without being read.
    pub fn from_file(path: &Path) -> Result<Self> {
        let bytes = checked_read::read_required(path, "tokenizer", Self::MAX_FILE_LEN)?;
        let inner = tokenizers::Tokenizer::from_bytes(&bytes)
            .map_err(|e| Error::invalid(path, format!("malformed tokenizer: {e}")))?;
        Ok(Self {
            inner: Arc::new(inner),
            specials_as_text: Arc::default(),
            derived: Arc::default(),
            path: path.into(),
        })
    }

    /// What `build` derives from this tokenizer, built on the first call
    /// and shared by clones (the constraints' token trie, about a second
    /// for Qwen3's vocabulary); `build`'s error is `checkpoint_invalid` of
    /// the tokenizer's file. Only one type is ever derived.
    pub(crate) fn derived<T: Any + Send + Sync>(
        &self,
        build: impl FnOnce(&Self) -> std::result::Result<T, String>,
    ) -> Result<Arc<T>> {
        let derived = self
            .derived
            .get_or_init(|| build(self).map(|t| Arc::new(t) as Arc<dyn Any + Send + Sync>))
            .clone()
            .map_err(|reason| Error::invalid(&*self.path, reason))?;
        derived.downcast::<T>().map_err(|_| Error::internal("a tokenizer derived two types"))
    }

    /// The Hugging Face tokenizer.
    pub(crate) fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }

    /// [`Self::inner`], shared (what is derived from the tokenizer may
    /// keep it without keeping the derived values alive in a cycle).
    pub(crate) fn shared_inner(&self) -> Arc<tokenizers::Tokenizer> {
        self.inner.clone()
    }

    /// Number of ids the tokenizer knows, added (special) tokens included.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// The id of a token string (`"<|im_end|>"`), if it exists.
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// Encodes `text` without adding special tokens (Qwen3 adds none anyway;
    /// chat templates are the caller's job). Special-token strings written in
    /// the text (`<|im_end|>`) become their control tokens: use
    /// [`encode_text`](Self::encode_text) for text a user typed.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        self.encode_with(&self.inner, text)
    }

    /// Encodes `text` with special-token parsing off: a `<|im_end|>` in the
    /// text is encoded as the characters it is made of, never as the control
    /// token, so text a user typed cannot end a turn or open a system turn.
    /// Added tokens that are not special (Qwen3's `<think>`, `<tool_call>`)
    /// are still recognised, as Hugging Face's `split_special_tokens` does.
    ///
    /// Text with no special-token string in it encodes exactly as
    /// [`encode`](Self::encode) does.
    pub fn encode_text(&self, text: &str) -> Result<Vec<u32>> {
        let specials = self.special_tokens();
        if !specials.iter().any(|s| text.contains(s.as_str())) {
            return self.encode(text);
        }
        let as_text = self.specials_as_text.get_or_init(|| {
            let mut copy = (*self.inner).clone();
            copy.set_encode_special_tokens(true);
            copy
        });
        self.encode_with(as_text, text)
    }

    fn encode_with(&self, tokenizer: &tokenizers::Tokenizer, text: &str) -> Result<Vec<u32>> {
        let encoding = tokenizer
            .encode(text, false)
            .map_err(|e| Error::invalid(&*self.path, format!("cannot encode text: {e}")))?;
        Ok(encoding.get_ids().to_vec())
    }

    /// The strings of the special (control) tokens, such as `<|im_start|>`
    /// and `<|im_end|>`, sorted by id.
    pub fn special_tokens(&self) -> Vec<String> {
        let mut tokens: Vec<(u32, String)> = self
            .inner
            .get_added_tokens_decoder()
            .into_iter()
            .filter(|(_, t)| t.special)
            .map(|(id, t)| (id, t.content))
            .collect();
        tokens.sort();
        tokens.into_iter().map(|(_, s)| s).collect()
    }

    /// Decodes `ids` to text, special tokens included (so the text shows
    /// exactly what the ids are). An id the tokenizer does not know is
    /// [`Error::InvalidTokenId`].
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.check_ids(ids, 0)?;
        self.decode_unchecked(ids)
    }

    fn decode_unchecked(&self, ids: &[u32]) -> Result<String> {
        self.inner
            .decode(ids, false)
            .map_err(|e| Error::invalid(&*self.path, format!("cannot decode ids: {e}")))
    }

    /// `first_position`: the position of `ids[0]` in the caller's sequence.
    fn check_ids(&self, ids: &[u32], first_position: usize) -> Result<()> {
        for (i, &id) in ids.iter().enumerate() {
            if self.inner.id_to_token(id).is_none() {
                return Err(Error::InvalidTokenId {
                    id,
                    position: first_position + i,
                    vocab_size: self.vocab_size(),
                });
            }
        }
        Ok(())
    }

    /// A streaming decoder over this tokenizer (holding its own handle to
    /// the vocabulary).
    pub fn stream(&self) -> TextStream {
        TextStream::new(self)
    }
}

/// Decodes ids one at a time, returning only complete UTF-8 text: bytes of
/// a character split across tokens are held back until the character is
/// complete, so the concatenated output equals [`Tokenizer::decode`] of all
/// ids, and never shows a U+FFFD that the full decode would not.
///
/// A stream owns a (cheap) clone of its [`Tokenizer`], so it borrows
/// nothing and can live in a long-lived object (a game engine's component)
/// after the `Tokenizer` it came from is dropped. Call
/// [`finish`](Self::finish) at the end of a generation for the text still
/// held back.
///
/// ```no_run
/// # fn main() -> qwen3_wgpu::Result<()> {
/// use qwen3_wgpu::Tokenizer;
/// let tokenizer = Tokenizer::from_checkpoint("Qwen3-0.6B".as_ref())?;
/// let ids = tokenizer.encode("Grüße, 世界")?;
/// let mut stream = tokenizer.stream();
/// drop(tokenizer); // the stream keeps what it needs
/// let mut text = String::new();
/// for id in ids {
///     text += &stream.push(id)?;
/// }
/// text += &stream.finish()?;
/// assert_eq!(text, "Grüße, 世界");
/// # Ok(())
/// # }
/// ```
pub struct TextStream {
    tokenizer: Tokenizer,
    ids: Vec<u32>,
    /// Start of the ids decoded as context for the next piece. Context
    /// matters because a decoder's output for an id can depend on its
    /// neighbours (byte-level merges, leading-space rules).
    prefix_offset: usize,
    /// Ids before this have been emitted.
    read_offset: usize,
    /// Ids pushed in total (positions in errors).
    position: usize,
}

/// An incomplete UTF-8 character has at most 3 bytes, so at most 3 tokens
/// can be held back for it; text still ending in U+FFFD after more pending
/// tokens than that is genuinely invalid and is emitted as it is.
const MAX_PENDING_TOKENS: usize = 4;

impl TextStream {
    /// A stream with nothing pushed yet.
    pub fn new(tokenizer: &Tokenizer) -> Self {
        Self { tokenizer: tokenizer.clone(), ids: Vec::new(), prefix_offset: 0, read_offset: 0, position: 0 }
    }

    /// Pushes one id; returns the text it completes (possibly empty).
    ///
    /// Errors: [`Error::InvalidTokenId`] for an unknown id (the stream is
    /// left as it was).
    pub fn push(&mut self, id: u32) -> Result<String> {
        self.tokenizer.check_ids(&[id], self.position)?;
        self.position += 1;
        self.ids.push(id);
        let prefix = self.tokenizer.decode_unchecked(&self.ids[self.prefix_offset..self.read_offset])?;
        let full = self.tokenizer.decode_unchecked(&self.ids[self.prefix_offset..])?;
        let pending = self.ids.len() - self.read_offset;
        let incomplete = full.ends_with('\u{FFFD}') && pending < MAX_PENDING_TOKENS;
        match full.get(prefix.len()..) {
            Some(piece) if full.len() > prefix.len() && !incomplete && full.starts_with(&prefix) => {
                let piece = piece.to_string();
                self.prefix_offset = self.read_offset;
                self.read_offset = self.ids.len();
                self.compact();
                Ok(piece)
            }
            _ => Ok(String::new()),
        }
    }

    /// Returns whatever is still held back (at the end of generation), even
    /// if it is an incomplete character (shown as U+FFFD).
    pub fn finish(&mut self) -> Result<String> {
        let prefix = self.tokenizer.decode_unchecked(&self.ids[self.prefix_offset..self.read_offset])?;
        let full = self.tokenizer.decode_unchecked(&self.ids[self.prefix_offset..])?;
        self.ids.clear();
        self.prefix_offset = 0;
        self.read_offset = 0;
        Ok(full.get(prefix.len()..).unwrap_or_default().to_string())
    }

    /// Drops ids no longer needed as context, so a long generation does not
    /// keep (or re-decode) its whole history.
    fn compact(&mut self) {
        if self.prefix_offset > 0 {
            self.ids.drain(..self.prefix_offset);
            self.read_offset -= self.prefix_offset;
            self.prefix_offset = 0;
        }
    }
}
