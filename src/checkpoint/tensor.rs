//! One tensor's bytes: where they lie, read from its file a window at a
//! time ([`TensorSource`]) or borrowed from the map ([`TensorData`]), as f32
//! rows.

use std::path::Path;

use safetensors::tensor::Dtype;

use super::file::WeightsFile;
use crate::error::{Error, Result};

/// Where one tensor's bytes lie: file index, absolute offset, length.
#[derive(Clone, Copy)]
pub(super) struct Extent {
    pub(super) file: usize,
    pub(super) offset: u64,
    pub(super) len: usize,
}

/// One tensor's bytes in its weights file, read with positioned reads (see
/// the module docs) from any thread: what the conversion reads, a piece at
/// a time, on several threads.
#[derive(Clone, Copy)]
pub struct TensorSource<'a> {
    pub(super) file: &'a WeightsFile,
    pub(super) name: &'a str,
    pub(super) dtype: Dtype,
    pub(super) shape: &'a [usize],
    pub(super) offset: u64,
    pub(super) row_bytes: usize,
    pub(super) rows: usize,
}

/// Upper bound of the conversion's read buffer, unless one row is longer:
/// small enough to stay in a core's cache between the read and its use.
pub const READ_WINDOW: usize = 256 << 10;

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
pub(super) fn is_readable_dtype(dtype: Dtype) -> bool {
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
