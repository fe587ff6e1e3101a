//! Whether the host has the memory a conversion's blob needs.

use crate::error::{Error, Result};

/// Bytes of host memory a new allocation can get without pushing the
/// system into swap or the OOM killer: `MemAvailable` of /proc/meminfo on
/// Linux; `None` where that is not known (other systems, or unreadable).
pub fn available_memory() -> Option<u64> {
    #[cfg(target_os = "linux")]
    {
        let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
        parse_mem_available(&meminfo)
    }
    #[cfg(not(target_os = "linux"))]
    {
        None
    }
}

/// `MemAvailable` in bytes from the text of /proc/meminfo.
pub(super) fn parse_mem_available(meminfo: &str) -> Option<u64> {
    let line = meminfo.lines().find_map(|l| l.strip_prefix("MemAvailable:"))?;
    let kib: u64 = line.trim().strip_suffix("kB")?.trim().parse().ok()?;
    kib.checked_mul(1024)
}

/// [`Error::OutOfMemory`] when `needed` bytes exceed `available` (unknown
/// availability passes: the allocation itself is then the check).
pub fn check_host_memory(what: &str, needed: u64, available: Option<u64>) -> Result<()> {
    match available {
        Some(available) if needed > available => {
            Err(Error::OutOfMemory { what: what.to_string(), needed, available })
        }
        _ => Ok(()),
    }
}
