//! Shared by the kernel test suites (WGSL on a Vulkan adapter, MSL through
//! the C++ shim): one CPU reference per kernel, so every backend's output is
//! checked against the same numbers.
#![allow(dead_code)] // each test crate uses its own subset

pub mod reference;
