//! A session's state beyond one session: [`Session::fork`] copies a prefix
//! into a second session on the GPU, and [`Session::save`] /
//! [`Model::restore_session`] write it to a file and read it back.
//!
//! # Session file format (version 2)
//!
//! Integers are little-endian; the KV rows are stored as the session holds
//! them: f16 pairs packed in little-endian u32 words, or (an int8 cache)
//! four int8 values a word, then one f32 scale per head and position
//! ([`KvFormat`]).
//!
//! | offset | size | content |
//! |---|---|---|
//! | 0 | 8 | magic `Q3WSESSN` |
//! | 8 | 4 | format version ([`SESSION_FORMAT_VERSION`]) |
//! | 12 | 4 | flags: bit 0 set when a token is pending, bit 1 for an int8 KV cache |
//! | 16 | 32 | the model's weights fingerprint, lower-case hex ([`Model::fingerprint`]) |
//! | 48 | 4 | `num_hidden_layers` |
//! | 52 | 4 | `num_key_value_heads` |
//! | 56 | 4 | `head_dim` |
//! | 60 | 4 | the pending token (0 when none) |
//! | 64 | 8 | capacity (positions) |
//! | 72 | 8 | `len`: positions in the KV cache |
//! | 80 | 4 `len` | the token ids of those positions |
//! | | | per layer: K, then V, each its rows `[kv_head][len][row]` (a row `head_dim / 2` u32, int8: `head_dim / 4`), then (int8) its scales `[kv_head][len]` f32 |
//! | end − 16 | 8 | xxh3-64 of every byte before it |
//! | end − 8 | 8 | end magic `Q3WSEND\0` |
//!
//! Version 1 files (f16 caches, bit 1 clear; otherwise the same) are still
//! read.
//!
//! A file is written to a unique temporary name in the target's directory,
//! fsynced and renamed into place, so the target name only ever holds a
//! complete file, and a failed save leaves none.
//!
//! A restore reads only a regular file (a FIFO, a device or a directory is
//! refused without being read), and checks the header against the file's
//! length (exactly what the header implies) and against the model (shape,
//! fingerprint, capacity) before it allocates anything the header sizes; a
//! file that fails any check is a named error, never an abort.

use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, BufWriter, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use xxhash_rust::xxh3::Xxh3Default;

use super::Session;
use crate::error::{Error, Result};
use crate::gpu_weights::ModelGpu;
use crate::kv_cache::KvFormat;
use crate::sampling::SamplingParams;
use crate::temp_file::TempFile;

/// Version of the session file format.
pub const SESSION_FORMAT_VERSION: u32 = 2;

/// The oldest session file version this build reads.
const OLDEST_READ_VERSION: u32 = 1;

const MAGIC: &[u8; 8] = b"Q3WSESSN";
const END_MAGIC: &[u8; 8] = b"Q3WSEND\0";
const HEADER_LEN: usize = 80;
const FOOTER_LEN: usize = 16;
const FINGERPRINT_LEN: usize = 32;
const FLAG_PENDING: u32 = 1;
/// The KV cache is int8 ([`KvFormat::Int8`]; version 2 on).
const FLAG_KV_INT8: u32 = 2;

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
        self.settle_batch();
        self.check_no_feed()?;
        if capacity < self.len {
            return Err(Error::ContextOverflow { needed: self.len, capacity });
        }
        let max = self.model.config.max_position_embeddings;
        if capacity == 0 || capacity > max {
            return Err(Error::ContextOverflow { needed: capacity, capacity: max });
        }
        let mut fork = Session::new(self.model.clone(), capacity, self.kv_format())?;
        fork.set_lookahead(self.lookahead);
        fork.prompt_batch = self.prompt_batch.min(fork.bufs.batch);
        if self.sampling != SamplingParams::default() {
            fork.set_sampling(&self.sampling)?;
        }
        let gpu = &self.model.gpu;
        let mut enc = self.encoder();
        // Steps queued ahead write only past `len` (KV rows, scales and
        // tokens after the pending one), so these are final; the copies
        // run after those steps in queue order anyway.
        if self.len > 0 {
            let spans = self.bufs.kv_layout.spans(self.len);
            let to_spans = fork.bufs.kv_layout.spans(self.len);
            for (src, dst) in self
                .bufs
                .k_cache
                .iter()
                .zip(&fork.bufs.k_cache)
                .chain(self.bufs.v_cache.iter().zip(&fork.bufs.v_cache))
            {
                for (&(from, bytes), &(to, _)) in spans.iter().zip(&to_spans) {
                    enc.copy_buffer_to_buffer(
                        src,
                        self.bufs.kv_offset + from,
                        dst,
                        fork.bufs.kv_offset + to,
                        bytes,
                    );
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
        self.settle_batch();
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
        let flags = if self.pending.is_some() { FLAG_PENDING } else { 0 }
            | if self.kv_format() == KvFormat::Int8 { FLAG_KV_INT8 } else { 0 };
        header.extend_from_slice(&flags.to_le_bytes());
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
            // One layer's K and V at a time: host memory stays bounded by
            // a layer, whatever the context.
            let gpu = &self.model.gpu;
            let spans = self.bufs.kv_layout.spans(self.len);
            let layer_bytes = 2 * self.bufs.kv_layout.position_bytes() * self.len as u64;
            let staging = gpu.readback("session save", layer_bytes as usize);
            for (k, v) in self.bufs.k_cache.iter().zip(&self.bufs.v_cache) {
                let mut enc = self.encoder();
                let mut to = 0;
                for cache in [k, v] {
                    for &(from, bytes) in &spans {
                        enc.copy_buffer_to_buffer(cache, self.bufs.kv_offset + from, &staging, to, bytes);
                        to += bytes;
                    }
                }
                gpu.queue.submit([enc.finish()]);
                let bytes = gpu.read(&staging)?;
                out.write_all(&bytes[..layer_bytes as usize]).map_err(write_err)?;
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

impl<R: BufRead> HashingReader<R> {
    /// Hashes the next `n` bytes without keeping them (the reader's own
    /// buffer is the only memory used).
    fn skip(&mut self, mut n: u64) -> std::io::Result<()> {
        while n > 0 {
            let buf = self.inner.fill_buf()?;
            if buf.is_empty() {
                return Err(std::io::ErrorKind::UnexpectedEof.into());
            }
            let take = n.min(buf.len() as u64) as usize;
            self.hash.update(&buf[..take]);
            self.inner.consume(take);
            n -= take as u64;
        }
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

/// Opens `path` for reading if it is a regular file, with its length as
/// the opened file reports it (the file, not a name that may be replaced
/// between a check and the open). A FIFO, a device (such as a link to
/// `/dev/zero`), a socket or a directory is refused without reading from
/// it: on Unix the open does not block (a FIFO with no writer would
/// otherwise wait forever), and the type is checked on the opened file.
fn open_regular(path: &Path) -> Result<(File, u64)> {
    let io = |what: &str, e: &dyn std::fmt::Display| Error::SessionIo {
        path: path.to_path_buf(),
        reason: format!("{what}: {e}"),
    };
    let mut options = OpenOptions::new();
    options.read(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        // O_NONBLOCK changes nothing for a regular file's reads.
        options.custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY);
    }
    #[cfg(not(unix))]
    {
        // No non-blocking open here: the type is checked by name first.
        let meta = std::fs::metadata(path).map_err(|e| io("cannot open", &e))?;
        if !meta.is_file() {
            return Err(not_regular(path, &meta.file_type()));
        }
    }
    let file = options.open(path).map_err(|e| io("cannot open", &e))?;
    let meta = file.metadata().map_err(|e| io("cannot stat", &e))?;
    if !meta.is_file() {
        return Err(not_regular(path, &meta.file_type()));
    }
    Ok((file, meta.len()))
}

fn not_regular(path: &Path, kind: &std::fs::FileType) -> Error {
    let kind = if kind.is_dir() { "a directory" } else { "a FIFO, device or socket" };
    Error::SessionFileInvalid { path: path.to_path_buf(), reason: format!("not a regular file ({kind})") }
}

/// The fixed-size part of a session file, as read (nothing checked yet).
struct Header {
    magic: [u8; 8],
    version: u32,
    flags: u32,
    fingerprint: String,
    layers: u64,
    heads: u64,
    head_dim: u64,
    pending: u32,
    capacity: u64,
    len: u64,
}

impl Header {
    fn parse(b: &[u8; HEADER_LEN]) -> Header {
        let mut magic = [0u8; 8];
        magic.copy_from_slice(&b[0..8]);
        Header {
            magic,
            version: u32_at(b, 8),
            flags: u32_at(b, 12),
            fingerprint: String::from_utf8_lossy(&b[16..16 + FINGERPRINT_LEN]).into_owned(),
            layers: u32_at(b, 48).into(),
            heads: u32_at(b, 52).into(),
            head_dim: u32_at(b, 56).into(),
            pending: u32_at(b, 60),
            capacity: u64_at(b, 64),
            len: u64_at(b, 72),
        }
    }

    /// The KV cache's format.
    fn kv_format(&self) -> KvFormat {
        if self.flags & FLAG_KV_INT8 != 0 {
            KvFormat::Int8
        } else {
            KvFormat::F16
        }
    }

    /// Bytes of one layer's K and V (rows and scales), if representable.
    fn layer_bytes(&self) -> Option<u64> {
        let position = match self.kv_format() {
            KvFormat::F16 => self.head_dim.checked_mul(2)?,
            KvFormat::Int8 => self.head_dim.checked_add(4)?,
        };
        self.heads.checked_mul(position)?.checked_mul(2)?.checked_mul(self.len)
    }

    /// The file length this header implies, if representable.
    fn file_len(&self) -> Option<u64> {
        self.layer_bytes()?
            .checked_mul(self.layers)?
            .checked_add(self.len.checked_mul(4)?)?
            .checked_add((HEADER_LEN + FOOTER_LEN) as u64)
    }
}

/// A zeroed buffer of `n` bytes, or [`Error::OutOfMemory`] where the host
/// cannot provide it (never an abort).
fn try_zeroed(n: u64, what: &str) -> Result<Vec<u8>> {
    let oom = || Error::OutOfMemory { what: what.to_string(), needed: n, available: 0 };
    let n = usize::try_from(n).map_err(|_| oom())?;
    let mut v = Vec::new();
    v.try_reserve_exact(n).map_err(|_| oom())?;
    v.resize(n, 0);
    Ok(v)
}

/// Reads, verifies and uploads a session file (see the module docs).
///
/// Nothing is allocated from the header's sizes until the header has been
/// checked against the file's real length (the exact length it implies,
/// computed without overflow) and against this model (shape, fingerprint,
/// the capacity to restore into): a host buffer of a layer's rows and a
/// session are then bounded by the model's own sizes at its
/// `max_position_embeddings`. A file that is not restored into this model
/// only streams through the checksum (a fixed buffer), so that the error
/// says whether it is intact. Every check on the whole file's checksum
/// comes before a session is returned.
pub(crate) fn restore(shared: &Arc<ModelGpu>, path: &Path, capacity: Option<usize>) -> Result<Session> {
    let invalid = |reason: String| Error::SessionFileInvalid { path: path.to_path_buf(), reason };
    let (file, file_len) = open_regular(path)?;
    if file_len < (HEADER_LEN + FOOTER_LEN) as u64 {
        return Err(invalid(format!("truncated: {file_len} bytes")));
    }
    // Never past the length checked below, should the file grow meanwhile.
    let buffer = usize::try_from(file_len).unwrap_or(usize::MAX).min(1 << 20);
    let mut input = HashingReader {
        inner: BufReader::with_capacity(buffer, file.take(file_len)),
        hash: Xxh3Default::new(),
    };
    let read_err = |e: std::io::Error| invalid(format!("cannot read (changed while read?): {e}"));
    let mut header_bytes = [0u8; HEADER_LEN];
    input.fill(&mut header_bytes).map_err(read_err)?;
    let header = Header::parse(&header_bytes);
    if &header.magic != MAGIC {
        return Err(invalid("not a session file (bad magic)".into()));
    }
    if !(OLDEST_READ_VERSION..=SESSION_FORMAT_VERSION).contains(&header.version) {
        return Err(invalid(format!(
            "format version {}, this build reads {OLDEST_READ_VERSION} to {SESSION_FORMAT_VERSION}",
            header.version
        )));
    }
    let implied = header.file_len();
    if implied != Some(file_len) {
        let implied = implied.map_or_else(|| "more than 2^64".to_string(), |n| n.to_string());
        return Err(invalid(format!(
            "the header implies {implied} bytes, the file has {file_len} (truncated, extended or damaged)"
        )));
    }
    let known_flags = if header.version >= 2 { FLAG_PENDING | FLAG_KV_INT8 } else { FLAG_PENDING };
    let kv_format = header.kv_format();
    if header.flags & !known_flags != 0
        || header.capacity == 0
        || header.len > header.capacity
        || !kv_format.fits_head_dim(usize::try_from(header.head_dim).unwrap_or(usize::MAX))
    {
        return Err(invalid("the header's flags, capacity or head_dim are not a saved session's".into()));
    }
    let pending = (header.flags & FLAG_PENDING != 0).then_some(header.pending);

    let cfg = &shared.config;
    let fingerprint = shared.fingerprint.get();
    let same_model = header.fingerprint == fingerprint
        && header.layers == cfg.num_hidden_layers as u64
        && header.heads == cfg.num_key_value_heads as u64
        && header.head_dim == cfg.head_dim as u64;
    let capacity = capacity.unwrap_or(usize::try_from(header.capacity).unwrap_or(usize::MAX));
    let max = cfg.max_position_embeddings;
    let fits = capacity >= 1 && capacity <= max && header.len <= capacity as u64;
    if !(same_model && fits) {
        // Only the checksum reads the body: whatever the header claims,
        // nothing is allocated for it.
        input.skip(file_len - (HEADER_LEN + FOOTER_LEN) as u64).map_err(read_err)?;
        check_footer(&mut input, &invalid)?;
        if header.fingerprint != fingerprint {
            return Err(Error::SessionModelMismatch {
                path: path.to_path_buf(),
                expected: fingerprint.to_string(),
                found: header.fingerprint,
            });
        }
        if !same_model {
            return Err(invalid("the model's fingerprint with another shape".into()));
        }
        return Err(match capacity {
            c if c > max || c == 0 => Error::ContextOverflow { needed: c, capacity: max },
            c => Error::ContextOverflow { needed: header.len as usize, capacity: c },
        });
    }
    // Bounded now: len <= capacity <= max_position_embeddings, and the
    // shape is this model's.
    let len = header.len as usize;
    let mut tokens = try_zeroed(4 * header.len, "session restore: token ids")?;
    let layer_bytes = header.layer_bytes().unwrap_or(0);
    let mut layer = try_zeroed(layer_bytes, "session restore: one layer's KV rows")?;
    let mut session = Session::new(shared.clone(), capacity, kv_format)?;

    input.fill(&mut tokens).map_err(read_err)?;
    for l in 0..cfg.num_hidden_layers {
        input.fill(&mut layer).map_err(read_err)?;
        if layer_bytes == 0 {
            continue;
        }
        // KV rows of unverified bytes are harmless: the session is
        // dropped unless the checksum below holds.
        let spans = session.bufs.kv_layout.spans(len);
        let mut from = 0;
        for cache in [&session.bufs.k_cache[l], &session.bufs.v_cache[l]] {
            for &(to, bytes) in &spans {
                let end = from + bytes as usize;
                shared.gpu.queue.write_buffer(cache, session.bufs.kv_offset + to, &layer[from..end]);
                from = end;
            }
        }
        // Hand the staged rows to the GPU layer by layer, so staging
        // memory stays bounded by a layer.
        shared.gpu.queue.submit(std::iter::empty::<wgpu::CommandBuffer>());
    }
    check_footer(&mut input, &invalid)?;
    let tokens: Vec<u32> =
        tokens.chunks_exact(4).map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
    let vocab = cfg.vocab_size;
    if let Some((at, id)) = tokens.iter().chain(&pending).enumerate().find(|(_, &id)| id as usize >= vocab) {
        return Err(invalid(format!("token id {id} at position {at} is outside the vocabulary of {vocab}")));
    }
    let all: Vec<u32> = tokens.iter().chain(&pending).copied().collect();
    if !all.is_empty() {
        shared.gpu.queue.write_buffer(&session.bufs.tokens, 0, &le_bytes(&all));
    }
    session.len = len;
    session.pending = pending;
    session.reset_gpu_position();
    Ok(session)
}

/// Reads the footer after the body and checks the end magic and the
/// checksum of everything before it.
fn check_footer<R: BufRead>(input: &mut HashingReader<R>, invalid: &dyn Fn(String) -> Error) -> Result<()> {
    let computed = input.hash.digest();
    let mut footer = [0u8; FOOTER_LEN];
    input
        .inner
        .read_exact(&mut footer)
        .map_err(|e| invalid(format!("cannot read (changed while read?): {e}")))?;
    let stored = u64_at(&footer, 0);
    if &footer[8..16] != END_MAGIC {
        return Err(invalid("bad end magic".into()));
    }
    if stored != computed {
        return Err(invalid(format!("checksum mismatch (stored {stored:016x}, computed {computed:016x})")));
    }
    Ok(())
}
