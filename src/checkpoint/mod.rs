//! Reading a Hugging Face Qwen3 checkpoint (`model.safetensors`, or shards
//! listed by `model.safetensors.index.json`) through memory maps, validating
//! it against its config, and fingerprinting it for the conversion cache.
//!
//! Tensor data is read with positioned reads into bounded buffers, never
//! through the memory map: a weights file truncated while it is read is then
//! an [`Error::CheckpointInvalid`] naming the file, not a SIGBUS. The map
//! only serves the header parse and [`Checkpoint::tensor`]'s borrowed views.

mod digest;
mod file;
mod tensor;
mod validate;

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use safetensors::tensor::Dtype;

use crate::config::{read_optional, regular_file_metadata, require_checkpoint_dir};
use crate::error::{Error, Result};
pub use digest::{combine_pieces, Fingerprint, TensorHasher, HASH_PIECE, MAX_HASH_THREADS};
pub use file::FileStamp;
use file::WeightsFile;
use tensor::Extent;
pub use tensor::{TensorData, TensorSource, READ_WINDOW};
pub use validate::expected_tensors;

/// Name of a single-file checkpoint's weights.
pub const SINGLE_FILE: &str = "model.safetensors";
/// Name of a sharded checkpoint's index.
pub const SHARD_INDEX: &str = "model.safetensors.index.json";

/// At most this many missing tensor names are spelled out in an error (the
/// rest are counted), so a wrong directory does not produce a 300-line error.
pub const MAX_LISTED_MISSING: usize = 32;

/// Bytes before a safetensors JSON header: its length as a little-endian u64.
const SAFETENSORS_LEN_PREFIX: usize = 8;

/// An opened checkpoint: every weights file memory-mapped, every header
/// parsed, and a map from tensor name to the file holding it.
pub struct Checkpoint {
    dir: PathBuf,
    files: Vec<WeightsFile>,
    /// Tensor name -> index into `files`.
    locations: HashMap<String, usize>,
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
