//! Shared by the kernel test suites (WGSL on a Vulkan adapter, MSL through
//! the C++ shim): one CPU reference per kernel and one set of cases, so
//! every backend runs the same inputs against the same numbers.
#![allow(dead_code)] // each test crate uses its own subset

pub mod cases;
pub mod reference;
