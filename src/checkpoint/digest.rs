//! Fingerprinting a checkpoint for the conversion cache: each tensor's
//! streamed xxh3 digest, its pieces spread over threads, and the sha256 key.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use sha2::{Digest, Sha256};
use xxhash_rust::xxh3::Xxh3Default;

use super::file::{FileStamp, WeightsFile};
use super::validate::expected_tensors;
use super::Checkpoint;
use crate::config::{read_optional, ModelConfig};
use crate::converted::{WeightFormat, QUANT_GROUP};
use crate::error::{Error, Result};
use crate::progress::{LoadPhase, Progress};

/// What identifies a checkpoint's content for the conversion cache: see
/// [`Checkpoint::fingerprint`].
#[derive(Debug, Clone)]
pub struct Fingerprint {
    /// The cache key: sha256, lower-case hex.
    pub key: String,
    /// Digest of every tensor the engine reads, by name (see
    /// [`TensorHasher`]); conversion checks the bytes it reads against these.
    pub tensor_digests: HashMap<String, u128>,
    /// Every weights file's stamp, by file name, as it was before any
    /// tensor byte was hashed.
    pub stamps: BTreeMap<String, FileStamp>,
}

/// Bytes hashed as one independent piece of a tensor's digest.
pub const HASH_PIECE: usize = 8 << 20;

/// Streaming digest of one tensor's bytes: xxh3-128 of every
/// [`HASH_PIECE`]-byte piece, then xxh3-128 over the byte count and the
/// pieces' digests ([`combine_pieces`]). Pieces hash independently, so
/// [`Checkpoint::fingerprint`] and the conversion spread one large tensor
/// over several threads and reach the same digest. xxh3 is not cryptographic: the key guards against
/// changed weights, not against someone crafting a collision on purpose.
#[derive(Clone, Default)]
pub struct TensorHasher {
    piece: Xxh3Default,
    piece_len: usize,
    piece_digests: Vec<u8>,
    total: u64,
}

impl TensorHasher {
    /// Feeds the next bytes of the tensor.
    pub fn update(&mut self, mut bytes: &[u8]) {
        while !bytes.is_empty() {
            let take = (HASH_PIECE - self.piece_len).min(bytes.len());
            self.piece.update(&bytes[..take]);
            self.piece_len += take;
            self.total += take as u64;
            bytes = &bytes[take..];
            if self.piece_len == HASH_PIECE {
                self.end_piece();
            }
        }
    }

    fn end_piece(&mut self) {
        self.piece_digests.extend_from_slice(&self.piece.digest128().to_le_bytes());
        self.piece.reset();
        self.piece_len = 0;
    }

    /// The digest of everything fed.
    pub fn finish(mut self) -> u128 {
        if self.piece_len > 0 {
            self.end_piece();
        }
        combine_pieces(self.total, &self.piece_digests)
    }
}

/// The digest of a tensor of `total` bytes from its pieces' xxh3-128
/// digests (little-endian, in order): what [`TensorHasher::finish`] returns.
pub fn combine_pieces(total: u64, piece_digests: &[u8]) -> u128 {
    let mut h = Xxh3Default::new();
    h.update(&total.to_le_bytes());
    h.update(piece_digests);
    h.digest128()
}

/// Bytes [`Checkpoint::fingerprint`] reads at once (as [`READ_WINDOW`](crate::checkpoint::READ_WINDOW)).
const READ_CHUNK: usize = 256 << 10;

impl Checkpoint {
    /// Identifies this checkpoint's content, converted to `weights`, for the
    /// cache. The key is a sha256 over the cache `format_version`, the
    /// weight format's name, [`QUANT_GROUP`],
    /// config.json's bytes, generation_config.json's bytes if present, every
    /// weights file's name, size and safetensors header (the first 8 + N
    /// bytes), and the name and [`TensorHasher`] digest of every tensor the
    /// engine reads for `cfg` (every byte of each, read with positioned reads
    /// on up to [`MAX_HASH_THREADS`] threads). Each part is length prefixed so
    /// no two different inputs hash the same stream. So any changed byte of
    /// any tensor the engine reads changes the key.
    ///
    /// The files' [`FileStamp`]s are taken before the first tensor byte is
    /// read; see [`changed_files`](Self::changed_files).
    ///
    /// Errors: [`Error::CheckpointNotFound`] without config.json;
    /// [`Error::CheckpointInvalid`] when a weights file is shorter than its
    /// header says (truncated since it was opened) or cannot be read.
    pub fn fingerprint(
        &self,
        cfg: &ModelConfig,
        format_version: u32,
        weights: WeightFormat,
    ) -> Result<Fingerprint> {
        self.fingerprint_with(cfg, format_version, weights, &Progress::none())
    }

    /// [`fingerprint`](Self::fingerprint), reporting [`LoadPhase::Hashing`]
    /// through `progress` (bytes: the tensors hashed); [`Error::Cancelled`]
    /// when it cancels.
    pub fn fingerprint_with(
        &self,
        cfg: &ModelConfig,
        format_version: u32,
        weights: WeightFormat,
        progress: &Progress<'_>,
    ) -> Result<Fingerprint> {
        let stamps = self.files.iter().map(|f| (f.name.clone(), f.stamp())).collect();
        let mut h = Sha256::new();
        let mut part = |bytes: &[u8]| {
            h.update((bytes.len() as u64).to_le_bytes());
            h.update(bytes);
        };
        part(b"qwen3-wgpu checkpoint fingerprint");
        part(&format_version.to_le_bytes());
        part(weights.name().as_bytes());
        part(&(QUANT_GROUP as u64).to_le_bytes());
        let config_path = self.dir.join("config.json");
        let config = read_optional(&config_path)?.ok_or_else(|| Error::CheckpointNotFound {
            path: config_path.clone(),
            reason: "file does not exist".into(),
        })?;
        part(&config);
        match read_optional(&self.dir.join("generation_config.json"))? {
            Some(gen) => {
                part(b"generation_config.json");
                part(&gen);
            }
            None => part(b"no generation_config.json"),
        }
        let mut files: Vec<&WeightsFile> = self.files.iter().collect();
        files.sort_by(|a, b| a.name.cmp(&b.name));
        for f in files {
            part(f.name.as_bytes());
            part(&(f.map.len() as u64).to_le_bytes());
            part(f.header_bytes());
        }
        let names: Vec<String> = expected_tensors(cfg)
            .into_iter()
            .map(|(name, _)| name)
            .filter(|name| self.locations.contains_key(name))
            .collect();
        let digests = self.tensor_digests(&names, progress)?;
        for (name, digest) in names.iter().zip(&digests) {
            part(name.as_bytes());
            part(&digest.to_le_bytes());
        }
        Ok(Fingerprint {
            key: hex(&h.finalize()),
            tensor_digests: names.into_iter().zip(digests).collect(),
            stamps,
        })
    }

    /// The [`TensorHasher`] digest of each of `names` (all present), in
    /// order, hashing [`HASH_PIECE`]-byte pieces on several threads.
    fn tensor_digests(&self, names: &[String], progress: &Progress<'_>) -> Result<Vec<u128>> {
        let mut extents = Vec::with_capacity(names.len());
        for name in names {
            extents.push(self.extent(name).ok_or_else(|| self.missing(name))?);
        }
        progress.begin(LoadPhase::Hashing, extents.iter().map(|e| e.len as u64).sum())?;
        // (tensor, offset within it, length) of every piece.
        let mut pieces = Vec::new();
        for (t, e) in extents.iter().enumerate() {
            pieces.extend((0..e.len).step_by(HASH_PIECE).map(|at| (t, at, HASH_PIECE.min(e.len - at))));
        }
        let threads = std::thread::available_parallelism()
            .map_or(1, |n| n.get())
            .clamp(1, MAX_HASH_THREADS)
            .min(pieces.len().max(1));
        let next = AtomicUsize::new(0);
        let failed = AtomicBool::new(false);
        let work = || -> Result<Vec<(usize, u128)>> {
            let mut buf = Vec::new();
            let mut done = Vec::new();
            while !failed.load(Ordering::Relaxed) {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(&(t, at, len)) = pieces.get(i) else { break };
                let e = extents[t];
                // Read in chunks that stay in the core's cache between the
                // copy and the hash.
                let mut hasher = Xxh3Default::new();
                for chunk_at in (at..at + len).step_by(READ_CHUNK) {
                    buf.resize(READ_CHUNK.min(at + len - chunk_at), 0);
                    let read = self.files[e.file].read_exact_at(e.offset + chunk_at as u64, &mut buf);
                    if let Err(err) = read.and_then(|()| progress.advance(buf.len() as u64)) {
                        failed.store(true, Ordering::Relaxed);
                        return Err(err);
                    }
                    hasher.update(&buf);
                }
                done.push((i, hasher.digest128()));
            }
            Ok(done)
        };
        let results: Vec<Result<Vec<(usize, u128)>>> = std::thread::scope(|s| {
            let handles: Vec<_> = (1..threads).map(|_| s.spawn(work)).collect();
            let mut results = vec![work()];
            for handle in handles {
                results.push(handle.join().unwrap_or_else(|_| {
                    Err(Error::invalid(&self.dir, "a thread hashing the checkpoint panicked"))
                }));
            }
            results
        });
        let mut piece_digests = vec![0u128; pieces.len()];
        for result in results {
            for (i, d) in result? {
                piece_digests[i] = d;
            }
        }
        progress.end()?;
        let mut per_tensor = vec![Vec::new(); extents.len()];
        for (&(t, _, _), d) in pieces.iter().zip(&piece_digests) {
            per_tensor[t].extend_from_slice(&d.to_le_bytes());
        }
        Ok(extents.iter().zip(&per_tensor).map(|(e, p)| combine_pieces(e.len as u64, p)).collect())
    }
}

/// Most threads [`Checkpoint::fingerprint`] hashes on (it runs at memory
/// speed; more threads than memory channels gain nothing).
pub const MAX_HASH_THREADS: usize = 8;

fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        s.push(char::from(DIGITS[usize::from(b >> 4)]));
        s.push(char::from(DIGITS[usize::from(b & 15)]));
    }
    s
}
