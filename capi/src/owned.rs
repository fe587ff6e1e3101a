//! Strings and token arrays handed to the caller. Each allocation starts
//! with a header holding its size and kind, so the free functions need no
//! length from the caller (a string may hold NUL bytes, so `strlen` could
//! not recover it) and can refuse a pointer of the other kind.

use std::alloc::{alloc, dealloc, Layout};
use std::ffi::c_char;

use qwen3_wgpu::Result;

use crate::{invalid, put, q3w_status, run};

/// Header bytes before the data: the data's size, then its kind.
const HEADER: usize = 16;
const KIND_STRING: u64 = 0x7133_7773_7472_696e; // "q3wstrin"
const KIND_TOKENS: u64 = 0x7133_7774_6f6b_656e; // "q3wtoken"

fn layout(data_bytes: usize) -> Result<Layout> {
    data_bytes.checked_add(HEADER).and_then(|n| Layout::from_size_align(n, HEADER).ok()).ok_or_else(|| {
        qwen3_wgpu::Error::OutOfMemory { what: "a returned buffer".into(), needed: u64::MAX, available: 0 }
    })
}

/// Copies `data` into a new allocation of `kind`; returns the data's address.
fn allocate(data: &[u8], kind: u64) -> Result<*mut u8> {
    let layout = layout(data.len())?;
    // SAFETY: the layout's size is at least HEADER, never zero.
    let base = unsafe { alloc(layout) };
    if base.is_null() {
        return Err(qwen3_wgpu::Error::OutOfMemory {
            what: "a returned buffer".into(),
            needed: layout.size() as u64,
            available: 0,
        });
    }
    // SAFETY: `base` has HEADER + data.len() bytes, aligned to 16.
    unsafe {
        base.cast::<u64>().write(data.len() as u64);
        base.cast::<u64>().add(1).write(kind);
        let start = base.add(HEADER);
        std::ptr::copy_nonoverlapping(data.as_ptr(), start, data.len());
        Ok(start)
    }
}

/// Frees what [`allocate`] returned for `kind`.
///
/// # Safety
/// `ptr` is NULL or the address an allocation of this module returned,
/// not yet freed.
unsafe fn release(ptr: *mut u8, kind: u64, name: &str) -> Result<()> {
    if ptr.is_null() {
        return Ok(());
    }
    // SAFETY: an allocation of this module starts HEADER bytes earlier.
    let base = unsafe { ptr.sub(HEADER) };
    // SAFETY: the header was written by `allocate`.
    let (len, found) = unsafe { (base.cast::<u64>().read(), base.cast::<u64>().add(1).read()) };
    if found != kind {
        return Err(invalid(name, "was not returned by this library as this kind of buffer"));
    }
    let layout = layout(len as usize)?;
    // SAFETY: allocated with this layout by `allocate`.
    unsafe { dealloc(base, layout) };
    Ok(())
}

/// A NUL-terminated copy of `text` for the caller (freed with
/// `q3w_string_free`), and its length in bytes without the NUL.
pub(crate) fn string(text: &str) -> Result<(*mut c_char, usize)> {
    let mut bytes = Vec::with_capacity(text.len() + 1);
    bytes.extend_from_slice(text.as_bytes());
    bytes.push(0);
    Ok((allocate(&bytes, KIND_STRING)?.cast(), text.len()))
}

/// Writes a new string and its length to the out-parameters.
///
/// # Safety
/// `out_text` is non-NULL and writable; `out_len` is NULL or writable.
pub(crate) unsafe fn put_string(
    s: &str,
    out_text: *mut *mut c_char,
    out_len: *mut usize,
) -> qwen3_wgpu::Result<()> {
    let (ptr, len) = string(s)?;
    // SAFETY: as the caller promises.
    unsafe {
        put(out_text, ptr);
        if !out_len.is_null() {
            put(out_len, len);
        }
    }
    Ok(())
}

/// A copy of `ids` for the caller (freed with `q3w_tokens_free`).
pub(crate) fn tokens(ids: &[u32]) -> Result<*mut u32> {
    Ok(allocate(bytemuck_bytes(ids), KIND_TOKENS)?.cast())
}

fn bytemuck_bytes(ids: &[u32]) -> &[u8] {
    // SAFETY: u32 has no padding; the byte view covers the same memory.
    unsafe { std::slice::from_raw_parts(ids.as_ptr().cast::<u8>(), std::mem::size_of_val(ids)) }
}

/// Frees a string this library returned through a `char **` out-parameter.
/// NULL is allowed (nothing happens). A token array is refused with
/// `Q3W_INVALID_ARGUMENT`.
#[no_mangle]
pub unsafe extern "C" fn q3w_string_free(text: *mut c_char) -> q3w_status {
    // SAFETY: NULL or a string of this library, as the caller promises.
    run("q3w_string_free", || unsafe { release(text.cast(), KIND_STRING, "text") })
}

/// Frees a token array this library returned through a `uint32_t **`
/// out-parameter. NULL is allowed (nothing happens). A string is refused
/// with `Q3W_INVALID_ARGUMENT`.
#[no_mangle]
pub unsafe extern "C" fn q3w_tokens_free(ids: *mut u32) -> q3w_status {
    // SAFETY: NULL or a token array of this library, as the caller promises.
    run("q3w_tokens_free", || unsafe { release(ids.cast(), KIND_TOKENS, "ids") })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strings_keep_inner_nul_bytes_and_free_by_their_header() {
        let (ptr, len) = string("a\0b").unwrap();
        assert_eq!(len, 3);
        let bytes = unsafe { std::slice::from_raw_parts(ptr.cast::<u8>(), 4) };
        assert_eq!(bytes, b"a\0b\0");
        // The wrong free function is refused, the right one frees.
        assert_eq!(unsafe { q3w_tokens_free(ptr.cast()) }, q3w_status::Q3W_INVALID_ARGUMENT);
        assert_eq!(unsafe { q3w_string_free(ptr) }, q3w_status::Q3W_OK);
        let ids = tokens(&[]).unwrap();
        assert!(!ids.is_null());
        assert_eq!(unsafe { q3w_tokens_free(ids) }, q3w_status::Q3W_OK);
        assert_eq!(unsafe { q3w_tokens_free(std::ptr::null_mut()) }, q3w_status::Q3W_OK);
        assert_eq!(unsafe { q3w_string_free(std::ptr::null_mut()) }, q3w_status::Q3W_OK);
    }
}
