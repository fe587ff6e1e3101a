//! Reading a Hugging Face Qwen3 checkpoint (`model.safetensors`, or shards
//! listed by `model.safetensors.index.json`) through memory maps, validating
//! it against its config, and fingerprinting it for the conversion cache.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use safetensors::tensor::{Dtype, Metadata};
use safetensors::SafeTensors;
use sha2::{Digest, Sha256};

use crate::config::{
    file_kind, read_optional, regular_file_metadata, require_checkpoint_dir, ModelConfig, ShapeProfile,
};
use crate::error::{Error, Mismatch, Result};
use crate::weights::QUANT_GROUP;

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
        Ok(Self { name: name.to_string(), path, map, header_len, metadata })
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

    /// One tensor's view, or `None` when no file holds it.
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

    /// A sha256 (lower-case hex) identifying this checkpoint for the cache,
    /// computed without reading all tensor data: the cache `format_version`,
    /// [`QUANT_GROUP`], config.json's bytes, generation_config.json's bytes
    /// if present, and for every weights file its name, size, safetensors
    /// header (the first 8 + N bytes) and [`FINGERPRINT_SAMPLES`] evenly
    /// spaced samples of its tensor data. Each part is length prefixed so no
    /// two different inputs hash the same stream.
    ///
    /// The samples are there because two fine-tunes of one base model have
    /// byte-identical configs and headers; without them they would share a
    /// cache file and the second would silently get the first's weights.
    /// Reading them costs a few hundred KiB per file. An edit confined to
    /// bytes between samples is not detected.
    pub fn fingerprint(&self, format_version: u32) -> Result<String> {
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
            for sample in data_samples(&f.map[f.data_start()..]) {
                part(sample);
            }
        }
        Ok(hex(&h.finalize()))
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

/// Number of tensor-data samples per weights file in
/// [`Checkpoint::fingerprint`].
pub const FINGERPRINT_SAMPLES: usize = 64;
/// Bytes per sample (one page).
const FINGERPRINT_SAMPLE_LEN: usize = 4096;

/// [`FINGERPRINT_SAMPLES`] evenly spaced slices of `data` (first and last
/// included), or all of `data` when it is smaller than that many samples.
fn data_samples(data: &[u8]) -> Vec<&[u8]> {
    let (n, len) = (FINGERPRINT_SAMPLES, FINGERPRINT_SAMPLE_LEN);
    if data.len() <= n * len {
        return vec![data];
    }
    let last_start = data.len() - len;
    (0..n).map(|i| &data[last_start * i / (n - 1)..][..len]).collect()
}

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
fn parse_shard_index(bytes: &[u8]) -> Result<BTreeMap<String, String>, String> {
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
