//! Reading a Hugging Face Qwen3 checkpoint (`model.safetensors`, or shards
//! listed by `model.safetensors.index.json`) through memory maps, validating
//! it against its config, and fingerprinting it for the conversion cache.
//!
//! Tensor data is read with positioned reads into bounded buffers, never
//! through the memory map: a weights file truncated while it is read is then
//! an [`Error::CheckpointInvalid`] naming the file, not a SIGBUS. The map
//! only serves the header parse and [`Checkpoint::tensor`]'s borrowed views.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::SystemTime;

use memmap2::Mmap;
use safetensors::tensor::{Dtype, Metadata};
use safetensors::SafeTensors;
use sha2::{Digest, Sha256};
use xxhash_rust::xxh3::Xxh3Default;

use crate::config::{
    file_kind, read_optional, regular_file_metadata, require_checkpoint_dir, ModelConfig, ShapeProfile,
};
use crate::converted::QUANT_GROUP;
use crate::error::{Error, Mismatch, Result};
use crate::progress::{LoadPhase, Progress};

/// Name of a single-file checkpoint's weights.
pub const SINGLE_FILE: &str = "model.safetensors";
/// Name of a sharded checkpoint's index.
pub const SHARD_INDEX: &str = "model.safetensors.index.json";

/// At most this many missing tensor names are spelled out in an error (the
/// rest are counted), so a wrong directory does not produce a 300-line error.
pub const MAX_LISTED_MISSING: usize = 32;

/// Bytes before a safetensors JSON header: its length as a little-endian u64.
const SAFETENSORS_LEN_PREFIX: usize = 8;

/// One memory-mapped `.safetensors` file with its parsed header.
struct WeightsFile {
    /// File name inside the checkpoint directory.
    name: String,
    path: PathBuf,
    /// The open file, for positioned reads of tensor data.
    file: File,
    map: Mmap,
    /// Length of the JSON header (the `N` of the format).
    header_len: usize,
    metadata: Metadata,
}

impl WeightsFile {
    /// Opens and maps `dir/name`. Every failure names the file: missing is
    /// [`Error::CheckpointNotFound`]; not a regular file (a directory, a
    /// FIFO whose open would block forever), unreadable, unmappable or
    /// malformed is [`Error::CheckpointInvalid`].
    fn open(dir: &Path, name: &str) -> Result<Self> {
        let path = dir.join(name);
        if regular_file_metadata(&path)?.is_none() {
            return Err(Error::CheckpointNotFound { path, reason: "weights file does not exist".into() });
        }
        let file = match File::open(&path) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(Error::CheckpointNotFound { path, reason: "weights file does not exist".into() })
            }
            Err(e) => return Err(Error::invalid(&path, format!("cannot open weights file: {e}"))),
        };
        // The handle's own metadata: what is mapped is a regular file even
        // if the path was swapped since the check above.
        let meta =
            file.metadata().map_err(|e| Error::invalid(&path, format!("cannot stat weights file: {e}")))?;
        if !meta.is_file() {
            let kind = file_kind(&meta.file_type());
            return Err(Error::invalid(&path, format!("is {kind}, not a regular file")));
        }
        let len = meta.len();
        if len < SAFETENSORS_LEN_PREFIX as u64 {
            // Mapping an empty file fails on some platforms; this reads better.
            return Err(Error::invalid(
                &path,
                format!("malformed safetensors: file is {len} bytes, shorter than its header length"),
            ));
        }
        // SAFETY: the map is read-only and private to this process. Its one
        // hazard is another process truncating or rewriting the file while it
        // is mapped (SIGBUS or torn reads). Checkpoint files are not modified
        // in place by their tools (downloads write elsewhere and rename), and
        // the map is what lets a multi-GB checkpoint be read without copying
        // it into the heap; callers must not edit a checkpoint while loading.
        let map = unsafe { Mmap::map(&file) }
            .map_err(|e| Error::invalid(&path, format!("cannot memory-map weights file: {e}")))?;
        // `SafeTensors::deserialize` is `read_metadata` plus a borrow of the
        // map; keeping the owned `Metadata` avoids a self-referential struct
        // while running the very same validation (header JSON, offsets
        // contiguous, sizes matching dtype*shape, buffer length exact).
        let (header_len, metadata) = SafeTensors::read_metadata(&map)
            .map_err(|e| Error::invalid(&path, format!("malformed safetensors: {e}")))?;
        Ok(Self { name: name.to_string(), path, file, map, header_len, metadata })
    }

    /// The file's tensor bytes start here.
    fn data_start(&self) -> usize {
        SAFETENSORS_LEN_PREFIX + self.header_len
    }

    /// The length prefix plus the JSON header: what identifies the file's
    /// layout for the cache key without reading the tensors.
    fn header_bytes(&self) -> &[u8] {
        &self.map[..self.data_start()]
    }

    /// Fills `buf` from byte `offset` of the file with positioned reads.
    /// A file that ends early (truncated since it was opened) is
    /// [`Error::CheckpointInvalid`] naming it.
    fn read_exact_at(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        let end = offset.saturating_add(buf.len() as u64);
        read_exact_at(&self.file, offset, buf).map_err(|e| {
            let reason = if e.kind() == std::io::ErrorKind::UnexpectedEof {
                format!(
                    "file ends before byte {end} that its header promises \
                     (truncated or rewritten while being read; it was {} bytes when opened)",
                    self.map.len()
                )
            } else {
                format!("cannot read bytes {offset}..{end}: {e}")
            };
            Error::invalid(&self.path, reason)
        })
    }

    /// Size and modification time now.
    fn stamp(&self) -> FileStamp {
        let meta = self.file.metadata().ok();
        FileStamp { len: meta.as_ref().map(|m| m.len()), modified: meta.and_then(|m| m.modified().ok()) }
    }
}

/// `read_exact` at an absolute offset, without moving a shared cursor (so
/// several threads can read one file).
fn read_exact_at(file: &File, mut offset: u64, mut buf: &mut [u8]) -> std::io::Result<()> {
    while !buf.is_empty() {
        #[cfg(unix)]
        let n = std::os::unix::fs::FileExt::read_at(file, buf, offset);
        #[cfg(windows)]
        let n = std::os::windows::fs::FileExt::seek_read(file, buf, offset);
        match n {
            Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => {
                buf = &mut buf[n..];
                offset += n as u64;
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// A weights file's size and modification time, taken when the checkpoint
/// is fingerprinted and compared again before its conversion is cached.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileStamp {
    /// Size in bytes (`None` when the file could not be stat'ed).
    pub len: Option<u64>,
    /// Modification time, where the platform reports one.
    pub modified: Option<SystemTime>,
}

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

/// Where one tensor's bytes lie: file index, absolute offset, length.
#[derive(Clone, Copy)]
struct Extent {
    file: usize,
    offset: u64,
    len: usize,
}

/// One tensor's bytes in its weights file, read with positioned reads (see
/// the module docs) from any thread: what the conversion reads, a piece at
/// a time, on several threads.
#[derive(Clone, Copy)]
pub struct TensorSource<'a> {
    file: &'a WeightsFile,
    name: &'a str,
    dtype: Dtype,
    shape: &'a [usize],
    offset: u64,
    row_bytes: usize,
    rows: usize,
}

/// Upper bound of the conversion's read buffer, unless one row is longer:
/// small enough to stay in a core's cache between the read and its use.
pub const READ_WINDOW: usize = 256 << 10;

/// Bytes [`Checkpoint::fingerprint`] reads at once (as [`READ_WINDOW`]).
const READ_CHUNK: usize = 256 << 10;

impl<'a> TensorSource<'a> {
    /// Tensor name.
    pub fn name(&self) -> &'a str {
        self.name
    }

    /// The weights file holding the tensor.
    pub fn path(&self) -> &'a Path {
        &self.file.path
    }

    /// Number of rows: the product of all but the last dimension.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Number of elements in one row: the last dimension (1 for a scalar).
    pub fn row_len(&self) -> usize {
        self.shape.last().copied().unwrap_or(1)
    }

    /// Bytes of one row (never 0).
    pub fn row_bytes(&self) -> usize {
        self.row_bytes
    }

    /// Bytes of the whole tensor: `rows() * row_bytes()`.
    pub fn len(&self) -> usize {
        self.rows * self.row_bytes
    }

    /// Whether the tensor holds no bytes (no rows).
    pub fn is_empty(&self) -> bool {
        self.rows == 0
    }

    /// Fills `buf` with the tensor's bytes from byte `at` of the tensor.
    /// A file that ends early is [`Error::CheckpointInvalid`] naming it.
    pub fn read_at(&self, at: usize, buf: &mut [u8]) -> Result<()> {
        if at.checked_add(buf.len()).is_none_or(|end| end > self.len()) {
            return Err(Error::invalid(
                &self.file.path,
                format!(
                    "{}: bytes {at}.. (+{}) are outside the tensor's {}",
                    self.name,
                    buf.len(),
                    self.len()
                ),
            ));
        }
        self.file.read_exact_at(self.offset + at as u64, buf)
    }

    /// Converts row `row` of `bytes` (whole rows of this tensor, as read by
    /// [`read_at`](Self::read_at) from a row boundary) to f32 into `out`
    /// (see [`TensorData::row_f32`]).
    pub fn row_f32(&self, bytes: &[u8], row: usize, out: &mut [f32]) -> Result<()> {
        let shape = [bytes.len() / self.row_bytes, self.row_len()];
        let view = TensorData { name: self.name, dtype: self.dtype, shape: &shape, bytes };
        view.row_f32(row, out)
    }
}

/// An opened checkpoint: every weights file memory-mapped, every header
/// parsed, and a map from tensor name to the file holding it.
pub struct Checkpoint {
    dir: PathBuf,
    files: Vec<WeightsFile>,
    /// Tensor name -> index into `files`.
    locations: HashMap<String, usize>,
}

/// A borrowed view of one tensor inside a mapped file.
#[derive(Clone, Copy)]
pub struct TensorData<'a> {
    /// Tensor name.
    pub name: &'a str,
    /// Stored dtype.
    pub dtype: Dtype,
    /// Stored shape.
    pub shape: &'a [usize],
    /// Raw little-endian bytes, `shape.product() * dtype.size()` long.
    pub bytes: &'a [u8],
}

/// Dtypes the converter reads.
fn is_readable_dtype(dtype: Dtype) -> bool {
    matches!(dtype, Dtype::BF16 | Dtype::F16 | Dtype::F32)
}

impl TensorData<'_> {
    /// Number of elements in one row: the last dimension (1 for a scalar).
    pub fn row_len(&self) -> usize {
        self.shape.last().copied().unwrap_or(1)
    }

    /// Number of rows: the product of all but the last dimension.
    pub fn rows(&self) -> usize {
        match self.shape.split_last() {
            Some((_, lead)) => lead.iter().product(),
            None => 1,
        }
    }

    /// Converts row `row` to f32 into `out` (whose length must be
    /// [`row_len`](Self::row_len)). Reads only that row's bytes.
    ///
    /// Errors: [`Error::UnsupportedDtype`] for dtypes other than BF16, F16
    /// and F32; [`Error::CheckpointInvalid`] when `row` or `out` do not fit.
    pub fn row_f32(&self, row: usize, out: &mut [f32]) -> Result<()> {
        let width = self.row_len();
        let elem = match self.dtype {
            Dtype::BF16 | Dtype::F16 => 2,
            Dtype::F32 => 4,
            other => {
                return Err(Error::UnsupportedDtype {
                    tensor: self.name.to_string(),
                    dtype: format!("{other:?}"),
                })
            }
        };
        let row_bytes = width.checked_mul(elem);
        let start = row.checked_mul(width).and_then(|e| e.checked_mul(elem));
        let src = start
            .zip(row_bytes)
            .and_then(|(s, n)| self.bytes.get(s..s.checked_add(n)?))
            .filter(|_| out.len() == width && row < self.rows())
            .ok_or_else(|| {
                Error::invalid(
                    self.name,
                    format!(
                        "row {row} of {} (width {width}) requested into {} slots",
                        self.rows(),
                        out.len()
                    ),
                )
            })?;
        match self.dtype {
            // bf16 is the top half of an f32: widening is a shift.
            Dtype::BF16 => {
                for (o, b) in out.iter_mut().zip(src.chunks_exact(2)) {
                    *o = f32::from_bits((u32::from(b[0]) | (u32::from(b[1]) << 8)) << 16);
                }
            }
            Dtype::F16 => {
                for (o, b) in out.iter_mut().zip(src.chunks_exact(2)) {
                    *o = half::f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32();
                }
            }
            Dtype::F32 => {
                for (o, b) in out.iter_mut().zip(src.chunks_exact(4)) {
                    *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                }
            }
            // Rejected above.
            _ => {}
        }
        Ok(())
    }

    /// The whole tensor as f32 (for the small norm vectors).
    pub fn to_f32_vec(&self) -> Result<Vec<f32>> {
        let width = self.row_len();
        let mut out = vec![0.0f32; self.rows() * width];
        if width > 0 {
            for (r, chunk) in out.chunks_exact_mut(width).enumerate() {
                self.row_f32(r, chunk)?;
            }
        }
        Ok(out)
    }
}

/// Every tensor the engine reads for `cfg`, with the shape config.json
/// implies, in checkpoint order. `lm_head.weight` is listed only when the
/// embeddings are untied.
pub fn expected_tensors(cfg: &ModelConfig) -> Vec<(String, Vec<usize>)> {
    expected_tensor_iter(cfg).collect()
}

/// Name suffixes of one layer's tensors, in checkpoint order.
const LAYER_TENSORS: [&str; 11] = [
    "input_layernorm.weight",
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "self_attn.q_norm.weight",
    "self_attn.k_norm.weight",
    "post_attention_layernorm.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
];

const LAYER_PREFIX: &str = "model.layers.";

/// The shape `cfg` implies for one of [`LAYER_TENSORS`].
fn layer_tensor_shape(cfg: &ModelConfig, suffix: &str) -> Option<Vec<usize>> {
    let (h, hd, inter) = (cfg.hidden_size, cfg.head_dim, cfg.intermediate_size);
    Some(match suffix {
        "input_layernorm.weight" | "post_attention_layernorm.weight" => vec![h],
        "self_attn.q_proj.weight" => vec![cfg.q_dim(), h],
        "self_attn.k_proj.weight" | "self_attn.v_proj.weight" => vec![cfg.kv_dim(), h],
        "self_attn.o_proj.weight" => vec![h, cfg.q_dim()],
        "self_attn.q_norm.weight" | "self_attn.k_norm.weight" => vec![hd],
        "mlp.gate_proj.weight" | "mlp.up_proj.weight" => vec![inter, h],
        "mlp.down_proj.weight" => vec![h, inter],
        _ => return None,
    })
}

/// [`expected_tensors`], one at a time: a config claiming millions of
/// layers costs nothing until its names are walked.
fn expected_tensor_iter(cfg: &ModelConfig) -> impl Iterator<Item = (String, Vec<usize>)> + '_ {
    let embed = ("model.embed_tokens.weight".to_string(), vec![cfg.vocab_size, cfg.hidden_size]);
    let layers = (0..cfg.num_hidden_layers).flat_map(move |i| {
        LAYER_TENSORS.iter().map(move |suffix| {
            let shape = layer_tensor_shape(cfg, suffix).unwrap_or_default();
            (format!("{LAYER_PREFIX}{i}.{suffix}"), shape)
        })
    });
    let norm = ("model.norm.weight".to_string(), vec![cfg.hidden_size]);
    let head = (!cfg.tie_word_embeddings)
        .then(|| ("lm_head.weight".to_string(), vec![cfg.vocab_size, cfg.hidden_size]));
    std::iter::once(embed).chain(layers).chain(std::iter::once(norm)).chain(head)
}

/// How many tensors [`expected_tensors`] lists (saturating).
fn expected_tensor_count(cfg: &ModelConfig) -> usize {
    cfg.num_hidden_layers
        .saturating_mul(LAYER_TENSORS.len())
        .saturating_add(2 + usize::from(!cfg.tie_word_embeddings))
}

/// Whether the engine reads a tensor called `name` under `cfg` (the
/// inverse of [`expected_tensors`], without listing them).
fn is_expected_tensor(cfg: &ModelConfig, name: &str) -> bool {
    match name {
        "model.embed_tokens.weight" | "model.norm.weight" => true,
        "lm_head.weight" => !cfg.tie_word_embeddings,
        _ => name.strip_prefix(LAYER_PREFIX).and_then(|rest| rest.split_once('.')).is_some_and(
            |(index, suffix)| {
                // The canonical spelling only: `model.layers.01.` is not layer 1.
                let layer = index.parse::<usize>().ok().filter(|i| i.to_string() == index);
                layer.is_some_and(|i| i < cfg.num_hidden_layers) && LAYER_TENSORS.contains(&suffix)
            },
        ),
    }
}

fn shape_text(shape: &[usize]) -> String {
    format!("{shape:?}")
}

impl Checkpoint {
    /// Opens `dir`: the shards named by `model.safetensors.index.json` when
    /// that exists, else `model.safetensors`. Every file is memory-mapped and
    /// its header parsed; no tensor data is read.
    ///
    /// Errors: [`Error::CheckpointNotFound`] when the directory, the weights
    /// file or a shard is missing (or `dir` is not a directory);
    /// [`Error::CheckpointInvalid`] for a malformed index or safetensors
    /// file, one that is not a regular file or cannot be opened or mapped
    /// (each naming the file), or a tensor stored twice.
    pub fn open(dir: &Path) -> Result<Self> {
        require_checkpoint_dir(dir)?;
        Self::open_dir(dir)
    }

    /// [`open`](Self::open) in a directory already checked to be one.
    pub(crate) fn open_dir(dir: &Path) -> Result<Self> {
        let index_path = dir.join(SHARD_INDEX);
        let mut files = Vec::new();
        let mut index_map: Option<BTreeMap<String, String>> = None;
        if let Some(index_bytes) = read_optional(&index_path)? {
            let weight_map = parse_shard_index(&index_bytes).map_err(|r| Error::invalid(&index_path, r))?;
            let mut shard_names: Vec<&String> = weight_map.values().collect();
            shard_names.sort();
            shard_names.dedup();
            for name in shard_names {
                files.push(WeightsFile::open(dir, name)?);
            }
            index_map = Some(weight_map);
        } else {
            let single = dir.join(SINGLE_FILE);
            if regular_file_metadata(&single)?.is_none() {
                return Err(Error::CheckpointNotFound {
                    path: single,
                    reason: format!("no weights: neither {SINGLE_FILE} nor {SHARD_INDEX} exists"),
                });
            }
            files.push(WeightsFile::open(dir, SINGLE_FILE)?);
        }

        let mut locations = HashMap::new();
        for (file_idx, file) in files.iter().enumerate() {
            for name in file.metadata.tensors().into_keys() {
                if let Some(prev) = locations.insert(name.clone(), file_idx) {
                    let prev_name = files.get(prev).map_or("?", |f: &WeightsFile| f.name.as_str());
                    return Err(Error::invalid(
                        dir,
                        format!("tensor {name} is stored in both {prev_name} and {}", file.name),
                    ));
                }
            }
        }
        if let Some(weight_map) = index_map {
            for (tensor, shard) in &weight_map {
                let found = locations.get(tensor).and_then(|&i| files.get(i)).map(|f| &f.name);
                if found != Some(shard) {
                    return Err(Error::invalid(
                        &index_path,
                        format!("weight_map puts {tensor} in {shard}, but that file does not hold it"),
                    ));
                }
            }
        }
        Ok(Self { dir: dir.to_path_buf(), files, locations })
    }

    /// The checkpoint directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The weights files' names, in the order they were opened.
    pub fn file_names(&self) -> Vec<&str> {
        self.files.iter().map(|f| f.name.as_str()).collect()
    }

    /// One tensor's view, or `None` when no file holds it. The view borrows
    /// the memory map: reading it after the file was truncated by another
    /// process faults (SIGBUS). The conversion and the fingerprint do not
    /// use it; they read through [`reader`](Self::reader).
    pub fn tensor(&self, name: &str) -> Option<TensorData<'_>> {
        let file = self.files.get(*self.locations.get(name)?)?;
        let info = file.metadata.info(name)?;
        let (start, end) = info.data_offsets;
        let bytes = file.map.get(file.data_start() + start..file.data_start() + end)?;
        Some(TensorData {
            name: self.locations.get_key_value(name)?.0,
            dtype: info.dtype,
            shape: &info.shape,
            bytes,
        })
    }

    /// Like [`tensor`](Self::tensor), but a missing tensor is
    /// [`Error::CheckpointInvalid`].
    pub fn require(&self, name: &str) -> Result<TensorData<'_>> {
        self.tensor(name).ok_or_else(|| Error::invalid(&self.dir, format!("missing tensor {name}")))
    }

    /// Checks, before any conversion, that every tensor `cfg` implies exists
    /// (else [`Error::CheckpointInvalid`] listing the missing names), that
    /// the checkpoint holds no tensor the engine would ignore (q/k/v biases,
    /// a classifier head, ...: else [`Error::UnsupportedArchitecture`] with
    /// profile `qwen3` naming each, since ignoring a tensor computes
    /// another model), that every tensor read is stored as BF16, F16 or F32
    /// (else [`Error::UnsupportedDtype`]), and has the implied shape (else
    /// [`Error::UnsupportedArchitecture`] with profile `config.json` naming
    /// every wrong tensor with both shapes).
    ///
    /// A stored `lm_head.weight` is accepted and ignored when the
    /// embeddings are tied: transformers ties the head to the embedding
    /// table after loading, discarding the stored one, so the model that
    /// checkpoint defines is the one with the embedding as its head.
    pub fn validate(&self, cfg: &ModelConfig) -> Result<()> {
        #[cfg(test)]
        crate::check_counts::count(&crate::check_counts::VALIDATION);
        // Counted, not listed: config.json alone must not make this build
        // millions of names (`num_hidden_layers` may be huge).
        let present = self.locations.keys().filter(|n| is_expected_tensor(cfg, n)).count();
        let missing_count = expected_tensor_count(cfg).saturating_sub(present);
        if missing_count > 0 {
            // Every name walked is present or missing, so the walk stops
            // after at most `present + MAX_LISTED_MISSING` names.
            let listed: Vec<String> = expected_tensor_iter(cfg)
                .filter(|(n, _)| !self.locations.contains_key(n))
                .map(|(n, _)| n)
                .take(MAX_LISTED_MISSING)
                .collect();
            let mut listed = listed.join(", ");
            if missing_count > MAX_LISTED_MISSING {
                listed.push_str(&format!(" and {} more", missing_count - MAX_LISTED_MISSING));
            }
            return Err(Error::invalid(&self.dir, format!("{missing_count} missing tensor(s): {listed}")));
        }
        let mut unexpected: Vec<&String> = self
            .locations
            .keys()
            .filter(|n| !(is_expected_tensor(cfg, n) || (cfg.tie_word_embeddings && *n == "lm_head.weight")))
            .collect();
        if !unexpected.is_empty() {
            unexpected.sort();
            let mut mismatches: Vec<Mismatch> = unexpected
                .iter()
                .take(MAX_LISTED_MISSING)
                .filter_map(|n| self.tensor(n))
                .map(|t| Mismatch {
                    field: t.name.to_string(),
                    expected: "absent (the engine does not read this tensor)".into(),
                    found: format!("{:?} {}", t.dtype, shape_text(t.shape)),
                })
                .collect();
            if unexpected.len() > MAX_LISTED_MISSING {
                mismatches.push(Mismatch {
                    field: format!("{} more tensors", unexpected.len() - MAX_LISTED_MISSING),
                    expected: "absent".into(),
                    found: "present".into(),
                });
            }
            return Err(Error::UnsupportedArchitecture {
                profile: ShapeProfile::AnyQwen3.name().into(),
                mismatches,
            });
        }
        // All present, so this walks no more names than the files hold.
        let expected = expected_tensors(cfg);
        let mut wrong_shapes = Vec::new();
        for (name, shape) in &expected {
            let Some(t) = self.tensor(name) else { continue };
            if !is_readable_dtype(t.dtype) {
                return Err(Error::UnsupportedDtype {
                    tensor: name.clone(),
                    dtype: format!("{:?}", t.dtype),
                });
            }
            if t.shape != shape.as_slice() {
                wrong_shapes.push(Mismatch {
                    field: name.clone(),
                    expected: shape_text(shape),
                    found: shape_text(t.shape),
                });
            }
        }
        if !wrong_shapes.is_empty() {
            return Err(Error::UnsupportedArchitecture {
                profile: "config.json".into(),
                mismatches: wrong_shapes,
            });
        }
        Ok(())
    }

    /// Identifies this checkpoint's content for the cache. The key is a
    /// sha256 over the cache `format_version`, [`QUANT_GROUP`],
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
    pub fn fingerprint(&self, cfg: &ModelConfig, format_version: u32) -> Result<Fingerprint> {
        self.fingerprint_with(cfg, format_version, &Progress::none())
    }

    /// [`fingerprint`](Self::fingerprint), reporting [`LoadPhase::Hashing`]
    /// through `progress` (bytes: the tensors hashed); [`Error::Cancelled`]
    /// when it cancels.
    pub fn fingerprint_with(
        &self,
        cfg: &ModelConfig,
        format_version: u32,
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

    /// The weights files whose size or modification time differs from
    /// `stamps` (taken by [`fingerprint`](Self::fingerprint)): files written
    /// to while this process read them.
    pub fn changed_files(&self, stamps: &BTreeMap<String, FileStamp>) -> Vec<&Path> {
        self.files
            .iter()
            .filter(|f| stamps.get(&f.name) != Some(&f.stamp()))
            .map(|f| f.path.as_path())
            .collect()
    }

    fn extent(&self, name: &str) -> Option<Extent> {
        let file_idx = *self.locations.get(name)?;
        let file = self.files.get(file_idx)?;
        let (start, end) = file.metadata.info(name)?.data_offsets;
        let offset = file.data_start().checked_add(start)?;
        Some(Extent { file: file_idx, offset: offset as u64, len: end.checked_sub(start)? })
    }

    fn missing(&self, name: &str) -> Error {
        Error::invalid(&self.dir, format!("missing tensor {name}"))
    }

    /// The [`TensorSource`] of one tensor; a missing tensor is
    /// [`Error::CheckpointInvalid`], a dtype other than BF16, F16 and F32
    /// [`Error::UnsupportedDtype`], a shape that does not match the
    /// tensor's bytes (or has an empty row) [`Error::CheckpointInvalid`].
    pub fn source(&self, name: &str) -> Result<TensorSource<'_>> {
        let (name, &file_idx) = self.locations.get_key_value(name).ok_or_else(|| self.missing(name))?;
        let extent = self.extent(name).ok_or_else(|| self.missing(name))?;
        let file = &self.files[file_idx];
        let info = file.metadata.info(name).ok_or_else(|| self.missing(name))?;
        let elem = match info.dtype {
            Dtype::BF16 | Dtype::F16 => 2,
            Dtype::F32 => 4,
            other => {
                return Err(Error::UnsupportedDtype { tensor: name.clone(), dtype: format!("{other:?}") })
            }
        };
        let row_len = info.shape.last().copied().unwrap_or(1);
        let rows: Option<usize> = match info.shape.split_last() {
            Some((_, lead)) => lead.iter().try_fold(1usize, |a, &d| a.checked_mul(d)),
            None => Some(1),
        };
        let row_bytes = row_len.checked_mul(elem).filter(|&n| n > 0);
        let (rows, row_bytes) =
            rows.zip(row_bytes).filter(|&(r, b)| r.checked_mul(b) == Some(extent.len)).ok_or_else(|| {
                Error::invalid(
                    &file.path,
                    format!("{name}: shape {:?} does not match its byte length", info.shape),
                )
            })?;
        Ok(TensorSource {
            file,
            name,
            dtype: info.dtype,
            shape: &info.shape,
            offset: extent.offset,
            row_bytes,
            rows,
        })
    }

    /// Asks the OS to start reading every weights file into the page cache
    /// (conversion reads all of it, in an order the file layout does not
    /// follow). Only a hint: failures are ignored, and it is a no-op off
    /// unix.
    pub fn prefetch(&self) {
        #[cfg(unix)]
        for f in &self.files {
            let _ = f.map.advise(memmap2::Advice::WillNeed);
        }
    }

    /// Paths of the mapped weights files (for diagnostics).
    pub fn file_paths(&self) -> Vec<&Path> {
        self.files.iter().map(|f| f.path.as_path()).collect()
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

/// Parses the index's `weight_map`; shard names must be plain file names so
/// an index cannot point outside the checkpoint directory.
pub(crate) fn parse_shard_index(bytes: &[u8]) -> Result<BTreeMap<String, String>, String> {
    let value: serde_json::Value =
        serde_json::from_slice(bytes).map_err(|e| format!("malformed JSON: {e}"))?;
    let map = value.get("weight_map").and_then(|m| m.as_object()).ok_or("missing weight_map object")?;
    let mut out = BTreeMap::new();
    for (tensor, file) in map {
        let file =
            file.as_str().ok_or_else(|| format!("weight_map entry for {tensor} is not a file name"))?;
        let plain = Path::new(file).file_name().is_some_and(|n| n == std::ffi::OsStr::new(file));
        if !plain || file == ".." {
            return Err(format!("weight_map entry for {tensor} is not a plain file name: {file}"));
        }
        out.insert(tensor.clone(), file.to_string());
    }
    if out.is_empty() {
        return Err("weight_map is empty".into());
    }
    Ok(out)
}
