//! A session's state beyond one session: [`Session::fork`] copies a prefix
//! into a second session on the GPU, and [`Session::save`] /
//! [`Model::restore_session`] write it to a file and read it back.
//!
//! # Session file format (version 1)
//!
//! Integers are little-endian; the KV rows are the GPU's f16 pairs packed in
//! little-endian u32 words, as the session holds them.
//!
//! | offset | size | content |
//! |---|---|---|
//! | 0 | 8 | magic `Q3WSESSN` |
//! | 8 | 4 | format version ([`SESSION_FORMAT_VERSION`]) |
//! | 12 | 4 | flags: bit 0 set when a token is pending |
//! | 16 | 32 | the model's weights fingerprint, lower-case hex ([`Model::fingerprint`]) |
//! | 48 | 4 | `num_hidden_layers` |
//! | 52 | 4 | `num_key_value_heads` |
//! | 56 | 4 | `head_dim` |
//! | 60 | 4 | the pending token (0 when none) |
//! | 64 | 8 | capacity (positions) |
//! | 72 | 8 | `len`: positions in the KV cache |
//! | 80 | 4 `len` | the token ids of those positions |
//! | | | per layer: its K rows, then its V rows, each `[kv_head][len][head_dim / 2]` u32 |
//! | end − 16 | 8 | xxh3-64 of every byte before it |
//! | end − 8 | 8 | end magic `Q3WSEND\0` |
//!
//! A file is written to a unique temporary name in the target's directory,
//! fsynced and renamed into place, so the target name only ever holds a
//! complete file, and a failed save leaves none.

use std::fs::File;
use std::io::{BufReader, BufWriter, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use xxhash_rust::xxh3::Xxh3Default;

use super::Session;
use crate::error::{Error, Result};
use crate::gpu_weights::ModelGpu;
use crate::sampling::SamplingParams;
use crate::temp_file::TempFile;

/// Version of the session file format.
pub const SESSION_FORMAT_VERSION: u32 = 1;

const MAGIC: &[u8; 8] = b"Q3WSESSN";
const END_MAGIC: &[u8; 8] = b"Q3WSEND\0";
const HEADER_LEN: usize = 80;
const FOOTER_LEN: usize = 16;
const FINGERPRINT_LEN: usize = 32;
const FLAG_PENDING: u32 = 1;

impl Session {
    /// A second session holding this one's context: its KV rows, token
    /// sequence and pending token are copied on the GPU (no round trip
    /// through the host), and its lookahead is this one's. The two are
    /// independent afterwards: one system prompt fed once can start many
    /// conversations. The fork has this session's capacity; see
    /// [`fork_with_capacity`](Self::fork_with_capacity).
    ///
    /// ```no_run
    /// # fn f(model: &qwen3_wgpu::Model) -> qwen3_wgpu::Result<()> {
    /// let mut shared = model.session()?;
    /// shared.feed(&[785, 6722, 315])?; // a system prompt, fed once
    /// let mut mira = shared.fork()?;
    /// let mut tomas = shared.fork()?;
    /// let a = mira.feed(&[9625, 374])?;
    /// let b = tomas.feed(&[17689, 374])?;
    /// # let _ = (a, b);
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// Errors: [`Error::InvalidArgument`] naming `session` while a feed is
    /// in progress ([`begin_feed`](Self::begin_feed)); a GPU failure
    /// allocating the fork.
    pub fn fork(&self) -> Result<Session> {
        self.fork_with_capacity(self.capacity())
    }

    /// [`fork`](Self::fork) into a session of `capacity` positions (at
    /// least [`len()`](Self::len), at most the model's
    /// `max_position_embeddings`, else [`Error::ContextOverflow`]).
    pub fn fork_with_capacity(&self, capacity: usize) -> Result<Session> {
        self.check_no_feed()?;
        if capacity < self.len {
            return Err(Error::ContextOverflow { needed: self.len, capacity });
        }
        let max = self.model.config.max_position_embeddings;
        if capacity == 0 || capacity > max {
            return Err(Error::ContextOverflow { needed: capacity, capacity: max });
        }
        let mut fork = Session::new(self.model.clone(), capacity)?;
        fork.set_lookahead(self.lookahead);
        if self.sampling != SamplingParams::default() {
            fork.set_sampling(&self.sampling)?;
        }
        let gpu = &self.model.gpu;
        let mut enc = self.encoder();
        // Steps queued ahead write only past `len` (KV rows and tokens
        // after the pending one), so these rows are final; the copies run
        // after those steps in queue order anyway.
        let row_bytes = 4 * self.row_words();
        let len_bytes = row_bytes * self.len as u64;
        if len_bytes > 0 {
            for (src, dst) in self
                .bufs
                .k_cache
                .iter()
                .zip(&fork.bufs.k_cache)
                .chain(self.bufs.v_cache.iter().zip(&fork.bufs.v_cache))
            {
                for head in 0..self.model.config.num_key_value_heads as u64 {
                    let from = self.bufs.kv_offset + head * self.capacity() as u64 * row_bytes;
                    let to = fork.bufs.kv_offset + head * capacity as u64 * row_bytes;
                    enc.copy_buffer_to_buffer(src, from, dst, to, len_bytes);
                }
            }
        }
        let tokens = self.len + usize::from(self.pending.is_some());
        if tokens > 0 {
            enc.copy_buffer_to_buffer(&self.bufs.tokens, 0, &fork.bufs.tokens, 0, 4 * tokens as u64);
        }
        gpu.queue.submit([enc.finish()]);
        fork.len = self.len;
        fork.pending = self.pending;
        fork.reset_gpu_position();
        Ok(fork)
    }

    /// The token ids of the positions in the KV cache, in order (the
    /// pending token is [`pending`](Self::pending)). Reads them back from
    /// the GPU (a wait).
    ///
    /// ```no_run
    /// # fn f(session: &qwen3_wgpu::Session) -> qwen3_wgpu::Result<()> {
    /// let context = session.tokens()?;
    /// assert_eq!(context.len(), session.len());
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// Errors: [`Error::InvalidArgument`] naming `session` while a feed is
    /// in progress; a GPU failure.
    pub fn tokens(&self) -> Result<Vec<u32>> {
        self.check_no_feed()?;
        if self.len == 0 {
            return Ok(Vec::new());
        }
        let bytes = self.model.gpu.download(&self.bufs.tokens, 4 * self.len)?;
        Ok(bytemuck::pod_collect_to_vec(&bytes))
    }

    /// Writes the session (its positions' tokens and KV rows, its pending
    /// token, its capacity, and the model's
    /// [fingerprint](crate::Model::fingerprint)) to `path`, for
    /// [`Model::restore_session`](crate::Model::restore_session). Written to a temporary file
    /// in the same directory and renamed into place: `path` only ever holds
    /// a complete file, and a failed save leaves no file. The file takes
    /// `len()` times `4 * num_hidden_layers * num_key_value_heads * head_dim`
    /// bytes (112 KiB per position for Qwen3-0.6B), plus 4 per position and
    /// 96. The session is left as it was (steps queued ahead stay queued).
    ///
    /// ```no_run
    /// # fn f(session: &qwen3_wgpu::Session) -> qwen3_wgpu::Result<()> {
    /// session.save("saves/npc-mira.q3s")?;
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// Errors: [`Error::SessionIo`] naming the path when the directory does
    /// not exist or the file cannot be written; [`Error::InvalidArgument`]
    /// naming `session` while a feed is in progress; a GPU failure reading
    /// the KV cache back.
    pub fn save(&self, path: impl AsRef<Path>) -> Result<()> {
        self.check_no_feed()?;
        let path = path.as_ref();
        let io = |what: &str, e: &dyn std::fmt::Display| Error::SessionIo {
            path: path.to_path_buf(),
            reason: format!("{what}: {e}"),
        };
        let dir = match path.parent() {
            Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
            _ => PathBuf::from("."),
        };
        let name = path.file_name().ok_or_else(|| io("not a file name", &path.display()))?;
        let (file, temp) = TempFile::create(&dir, &name.to_string_lossy())
            .map_err(|e| io("cannot create a file in its directory", &e))?;
        let mut out =
            HashingWriter { inner: BufWriter::with_capacity(1 << 20, file), hash: Xxh3Default::new() };
        let write_err = |e: std::io::Error| io("cannot write", &e);

        let cfg = &self.model.config;
        let mut header = Vec::with_capacity(HEADER_LEN);
        header.extend_from_slice(MAGIC);
        header.extend_from_slice(&SESSION_FORMAT_VERSION.to_le_bytes());
        header.extend_from_slice(&(if self.pending.is_some() { FLAG_PENDING } else { 0 }).to_le_bytes());
        header.extend_from_slice(self.model.fingerprint.get().as_bytes());
        for v in [cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim] {
            header.extend_from_slice(&(v as u32).to_le_bytes());
        }
        header.extend_from_slice(&self.pending.unwrap_or(0).to_le_bytes());
        header.extend_from_slice(&(self.capacity() as u64).to_le_bytes());
        header.extend_from_slice(&(self.len as u64).to_le_bytes());
        if header.len() != HEADER_LEN {
            return Err(Error::internal(format!("session header of {} bytes", header.len())));
        }
        out.write_all(&header).map_err(write_err)?;
        out.write_all(&le_bytes(&self.tokens()?)).map_err(write_err)?;
        if self.len > 0 {
            // One layer's K and V rows at a time: host memory stays bounded
            // by a layer, whatever the context.
            let gpu = &self.model.gpu;
            let row_bytes = 4 * self.row_words();
            let len_bytes = row_bytes * self.len as u64;
            let heads = cfg.num_key_value_heads as u64;
            let staging = gpu.readback("session save", (2 * heads * len_bytes) as usize);
            for (k, v) in self.bufs.k_cache.iter().zip(&self.bufs.v_cache) {
                let mut enc = self.encoder();
                for (i, cache) in [k, v].into_iter().enumerate() {
                    for head in 0..heads {
                        let from = self.bufs.kv_offset + head * self.capacity() as u64 * row_bytes;
                        let to = (i as u64 * heads + head) * len_bytes;
                        enc.copy_buffer_to_buffer(cache, from, &staging, to, len_bytes);
                    }
                }
                gpu.queue.submit([enc.finish()]);
                let bytes = gpu.read(&staging)?;
                out.write_all(&bytes[..(2 * heads * len_bytes) as usize]).map_err(write_err)?;
            }
        }
        let checksum = out.hash.digest();
        let mut file = out.inner.into_inner().map_err(|e| io("cannot write", &e.error()))?;
        file.write_all(&checksum.to_le_bytes()).map_err(write_err)?;
        file.write_all(END_MAGIC).map_err(write_err)?;
        temp.persist(file, path).map_err(|(step, e)| match step {
            "sync" => io("cannot sync", &e),
            _ => io("cannot rename the file into place", &e),
        })
    }

    /// The model's configuration.
    pub(crate) fn model_config(&self) -> &crate::config::ModelConfig {
        &self.model.config
    }

    /// u32 words of one KV row of one head.
    fn row_words(&self) -> u64 {
        (self.model.config.head_dim / 2) as u64
    }
}

/// Words as the file stores them (little-endian).
fn le_bytes(words: &[u32]) -> Vec<u8> {
    words.iter().flat_map(|w| w.to_le_bytes()).collect()
}

/// A writer that hashes everything written through it.
struct HashingWriter<W: Write> {
    inner: W,
    hash: Xxh3Default,
}

impl<W: Write> Write for HashingWriter<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.hash.update(&buf[..n]);
        Ok(n)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

/// A reader that hashes everything read through it.
struct HashingReader<R: Read> {
    inner: R,
    hash: Xxh3Default,
}

impl<R: Read> HashingReader<R> {
    /// Reads exactly `buf.len()` bytes (the file's size was checked first,
    /// so a short read means it changed while being read).
    fn fill(&mut self, buf: &mut [u8]) -> std::io::Result<()> {
        self.inner.read_exact(buf)?;
        self.hash.update(buf);
        Ok(())
    }
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut w = [0u8; 8];
    w.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(w)
}

/// Reads, verifies and uploads a session file (see the module docs): one
/// pass, uploading the KV rows as they are read when the file claims this
/// model; every check on the whole file's checksum comes before the
/// session is returned.
pub(crate) fn restore(shared: &Arc<ModelGpu>, path: &Path, capacity: Option<usize>) -> Result<Session> {
    let io = |what: &str, e: &dyn std::fmt::Display| Error::SessionIo {
        path: path.to_path_buf(),
        reason: format!("{what}: {e}"),
    };
    let invalid = |reason: String| Error::SessionFileInvalid { path: path.to_path_buf(), reason };
    // The type first: opening a FIFO for reading would block until a writer came.
    let meta = std::fs::metadata(path).map_err(|e| io("cannot open", &e))?;
    if !meta.is_file() {
        return Err(invalid("not a regular file".into()));
    }
    let file = File::open(path).map_err(|e| io("cannot open", &e))?;
    let file_len = file.metadata().map_err(|e| io("cannot stat", &e))?.len();
    if file_len < (HEADER_LEN + FOOTER_LEN) as u64 {
        return Err(invalid(format!("truncated: {file_len} bytes")));
    }
    let mut input =
        HashingReader { inner: BufReader::with_capacity(1 << 20, file), hash: Xxh3Default::new() };
    let read_err = |e: std::io::Error| invalid(format!("cannot read (changed while read?): {e}"));
    let mut header = [0u8; HEADER_LEN];
    input.fill(&mut header).map_err(read_err)?;
    if &header[0..8] != MAGIC {
        return Err(invalid("not a session file (bad magic)".into()));
    }
    let version = u32_at(&header, 8);
    if version != SESSION_FORMAT_VERSION {
        return Err(invalid(format!("format version {version}, this build reads {SESSION_FORMAT_VERSION}")));
    }
    let flags = u32_at(&header, 12);
    let found = String::from_utf8_lossy(&header[16..16 + FINGERPRINT_LEN]).into_owned();
    let (layers, heads, head_dim) =
        (u32_at(&header, 48) as u64, u32_at(&header, 52) as u64, u32_at(&header, 56) as u64);
    let pending = (flags & FLAG_PENDING != 0).then(|| u32_at(&header, 60));
    let saved_capacity = u64_at(&header, 64);
    let len = u64_at(&header, 72);
    // The size the header implies, computed without overflow.
    let layer_bytes =
        heads.checked_mul(head_dim / 2).and_then(|w| w.checked_mul(8)).and_then(|b| b.checked_mul(len));
    let expected = layer_bytes
        .and_then(|b| b.checked_mul(layers))
        .and_then(|kv| kv.checked_add(len.checked_mul(4)?))
        .and_then(|body| body.checked_add((HEADER_LEN + FOOTER_LEN) as u64));
    if expected != Some(file_len)
        || flags & !FLAG_PENDING != 0
        || len > saved_capacity
        || !head_dim.is_multiple_of(2)
    {
        return Err(invalid(format!(
            "the header does not describe this file ({file_len} bytes; truncated, extended or damaged)"
        )));
    }
    let layer_bytes = layer_bytes.unwrap_or(0) as usize;
    let len = len as usize;

    let cfg = &shared.config;
    let fingerprint = shared.fingerprint.get();
    let same_model = found == fingerprint
        && layers == cfg.num_hidden_layers as u64
        && heads == cfg.num_key_value_heads as u64
        && head_dim == cfg.head_dim as u64;
    let capacity = capacity.unwrap_or(usize::try_from(saved_capacity).unwrap_or(usize::MAX));
    let max = cfg.max_position_embeddings;
    let fits = capacity >= len && capacity >= 1 && capacity <= max;
    let mut session = if same_model && fits { Some(Session::new(shared.clone(), capacity)?) } else { None };

    let mut tokens = vec![0u8; 4 * len];
    input.fill(&mut tokens).map_err(read_err)?;
    let mut layer = vec![0u8; layer_bytes];
    for l in 0..layers as usize {
        input.fill(&mut layer).map_err(read_err)?;
        if let (Some(s), true) = (&session, layer_bytes > 0) {
            // KV rows of unverified bytes are harmless: the session is
            // dropped unless the checksum below holds.
            let row_bytes = 4 * s.row_words() as usize;
            let len_bytes = row_bytes * len;
            let heads = heads as usize;
            for (i, cache) in [&s.bufs.k_cache[l], &s.bufs.v_cache[l]].into_iter().enumerate() {
                for head in 0..heads {
                    let from = (i * heads + head) * len_bytes;
                    let to = s.bufs.kv_offset + (head * capacity * row_bytes) as u64;
                    shared.gpu.queue.write_buffer(cache, to, &layer[from..from + len_bytes]);
                }
            }
            // Hand the staged rows to the GPU layer by layer, so staging
            // memory stays bounded by a layer.
            shared.gpu.queue.submit(std::iter::empty::<wgpu::CommandBuffer>());
        }
    }
    let computed = input.hash.digest();
    let mut footer = [0u8; FOOTER_LEN];
    input.inner.read_exact(&mut footer).map_err(read_err)?;
    let stored = u64_at(&footer, 0);
    if &footer[8..16] != END_MAGIC {
        return Err(invalid("bad end magic".into()));
    }
    if stored != computed {
        return Err(invalid(format!("checksum mismatch (stored {stored:016x}, computed {computed:016x})")));
    }
    if found != fingerprint {
        return Err(Error::SessionModelMismatch {
            path: path.to_path_buf(),
            expected: fingerprint.to_string(),
            found,
        });
    }
    if !same_model {
        return Err(invalid("the model's fingerprint with another shape".into()));
    }
    if !fits {
        return Err(match capacity {
            c if c > max || c == 0 => Error::ContextOverflow { needed: c, capacity: max },
            c => Error::ContextOverflow { needed: len, capacity: c },
        });
    }
    let tokens: Vec<u32> =
        tokens.chunks_exact(4).map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
    let vocab = cfg.vocab_size;
    if let Some((at, id)) = tokens.iter().chain(&pending).enumerate().find(|(_, &id)| id as usize >= vocab) {
        return Err(invalid(format!("token id {id} at position {at} is outside the vocabulary of {vocab}")));
    }
    let mut session = session.take().ok_or_else(|| Error::internal("no session to restore into"))?;
    let all: Vec<u32> = tokens.iter().chain(&pending).copied().collect();
    if !all.is_empty() {
        shared.gpu.queue.write_buffer(&session.bufs.tokens, 0, &le_bytes(&all));
    }
    session.len = len;
    session.pending = pending;
    session.reset_gpu_position();
    Ok(session)
}
