//! The tokenizer's vocabulary as llguidance sees it: each token's bytes in
//! a token trie, and the parser factory every constraint compiles with.
//! Built once per tokenizer (shared by its clones), on first use.

use std::sync::Arc;

use llguidance::toktrie::{ApproximateTokEnv, TokRxInfo, TokTrie};
use llguidance::ParserFactory;

use crate::tokenizer::Tokenizer;

/// The token environment and parser factory of one tokenizer.
pub(crate) struct ConstraintVocabulary {
    pub(crate) factory: ParserFactory,
    /// The end-of-text tokens a complete grammar allows.
    pub(crate) eos: Vec<u32>,
    /// The tokenizer, to spell the bytes a grammar forces as its tokens.
    tokenizer: Arc<tokenizers::Tokenizer>,
}

impl ConstraintVocabulary {
    /// The vocabulary of `tokenizer`, its end-of-text tokens (`<|im_end|>`,
    /// `<|endoftext|>`, whichever it has) allowed once a grammar is
    /// complete. The error is why the vocabulary cannot be used
    /// (`checkpoint_invalid` of the tokenizer's file, for the caller).
    pub(crate) fn new(tokenizer: &Tokenizer) -> std::result::Result<Self, String> {
        let inner = tokenizer.inner();
        let vocab_size = inner.get_vocab_size(true);
        let unicode_to_byte = unicode_to_byte();
        let added = inner.get_added_tokens_decoder();
        let mut words = Vec::with_capacity(vocab_size);
        for id in 0..vocab_size as u32 {
            let word = match added.get(&id) {
                // Special tokens are marked so that no text can spell them.
                Some(t) if t.special => {
                    std::iter::once(TokTrie::SPECIAL_TOKEN_MARKER).chain(t.content.bytes()).collect()
                }
                // Other added tokens (Qwen3's `<think>`, `<tool_call>`) are their text.
                Some(t) => t.content.as_bytes().to_vec(),
                None => match inner.id_to_token(id) {
                    Some(token) => byte_level_bytes(&token, &unicode_to_byte).ok_or_else(|| {
                        format!(
                            "constraints need a byte-level BPE vocabulary (as Qwen3's); token {id} ({token:?}) \
                             has characters outside the byte-level alphabet"
                        )
                    })?,
                    None => Vec::new(),
                },
            };
            words.push(word);
        }
        let eos: Vec<u32> =
            ["<|im_end|>", "<|endoftext|>"].iter().filter_map(|t| tokenizer.token_id(t)).collect();
        let Some(&first_eos) = eos.first() else {
            return Err(
                "constraints need an end-of-text token (<|im_end|> or <|endoftext|>) in the vocabulary"
                    .into(),
            );
        };
        let info = TokRxInfo::new(vocab_size as u32, first_eos);
        // The vocabulary comes from a file: toktrie's assertions on it
        // become this tokenizer's error, not the caller's crash.
        let factory = std::panic::catch_unwind(|| {
            let trie = TokTrie::from(&info, &words).with_eos_tokens(&eos);
            let env = ApproximateTokEnv::new(trie);
            ParserFactory::new_simple(&(Arc::new(env) as llguidance::toktrie::TokEnv))
        })
        .map_err(|_| "llguidance cannot use the vocabulary (it panicked)".to_string())?;
        let mut factory = factory.map_err(|e| format!("llguidance cannot use the vocabulary: {e}"))?;
        factory.quiet();
        Ok(Self { factory, eos, tokenizer: tokenizer.shared_inner() })
    }

    /// The tokens that surely spell the start of `forced`, bytes a grammar
    /// forces: the tokenizer's own tokens (those a model trained on its
    /// output writes), but the last, which the bytes after `forced` could
    /// merge into another; none where the tokens would not spell the bytes
    /// exactly (text the tokenizer normalises, bytes that are not UTF-8).
    /// The matcher keeps its mask free of this choice (llguidance's
    /// canonical forcing would allow only the one token it picks, which a
    /// model with fewer logits than the tokenizer may not have).
    pub(crate) fn forced_tokens(&self, forced: &[u8]) -> Vec<u32> {
        let Some(mut ids) = std::str::from_utf8(forced)
            .ok()
            .and_then(|text| self.tokenizer.encode_fast(text, false).ok())
            .map(|e| e.get_ids().to_vec())
        else {
            return Vec::new();
        };
        ids.pop();
        let trie = self.factory.tok_env().tok_trie();
        let spelled = trie.decode_raw(&ids);
        if !forced.starts_with(&spelled) {
            return Vec::new();
        }
        ids
    }
}

/// The bytes a byte-level BPE token string stands for (GPT-2's alphabet:
/// each byte is one character), or `None` when a character is outside it.
fn byte_level_bytes(token: &str, unicode_to_byte: &[Option<u8>]) -> Option<Vec<u8>> {
    token.chars().map(|c| unicode_to_byte.get(c as usize).copied().flatten()).collect()
}

/// GPT-2's byte-level alphabet, inverted: printable Latin-1 bytes stand for
/// themselves, the other 68 bytes for U+0100 onwards, in byte order.
fn unicode_to_byte() -> Vec<Option<u8>> {
    let mut table = vec![None; 512];
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    let mut next = 256usize;
    for b in 0..=255u8 {
        if printable(b) {
            table[b as usize] = Some(b);
        } else {
            table[next] = Some(b);
            next += 1;
        }
    }
    table
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_level_alphabet_covers_every_byte_once() {
        let table = unicode_to_byte();
        let mut seen = [false; 256];
        for b in table.iter().flatten() {
            assert!(!seen[*b as usize], "byte {b} twice");
            seen[*b as usize] = true;
        }
        assert!(seen.iter().all(|&s| s));
        // GPT-2: space is U+0120 ('Ġ'), newline U+010A ('Ċ').
        assert_eq!(byte_level_bytes("Ġhello", &table), Some(b" hello".to_vec()));
        assert_eq!(byte_level_bytes("Ċ", &table), Some(b"\n".to_vec()));
        assert_eq!(byte_level_bytes("▁x", &table), None);
    }
}
