//! The manual: one page per topic, beside the API reference.
//!
//! Start with the [crate overview](crate) or the README's example; then:
//!
//! | page | what it covers |
//! |---|---|
//! | [`command_line`] | the `decode` example's flags and output, the `chat` example, `doctor`, the other tools, logging |
//! | [`loading`] | where a checkpoint comes from, loading it, progress and cancelling, the weights cache |
//! | [`generating`] | one call from prompt to tokens: budgets, end-of-text ids, stop strings, callbacks |
//! | [`sampling`] | temperature, top-k, top-p, min-p, penalties and seeds on the GPU; log-probabilities |
//! | [`sessions`] | a context on the GPU: feeding, steps queued ahead, rewinding, forking, saving and restoring |
//! | [`rendering`] | decoding inside a renderer's frame loop: a shared device, calls that never wait |
//! | [`batches`] | many sessions advanced by one GPU step |
//! | [`chat`] | conversations with an instruct model, and its chat template |
//! | [`constraints`] | output that must match a JSON schema, a regular expression or a grammar |
//! | [`text`] | streaming text token by token, stop strings, special tokens |
//! | [`errors`] | every stable error code and what to do about it |
//! | [`c_api`] | the C ABI (`capi/`) and its C and C++ examples |
//! | [`environment`] | the environment variables the engine, the tools and the tests read |
//! | [`how_it_runs`] | a decode step and a prompt batch on the GPU; the start-up self-check |
//! | [`metal`] | the Metal fast path: the hand-written MSL kernels and how they are tested without a Mac |
//! | [`speed`] | where the speed figures are and the tools that measure them |
//! | [`testing`] | the test command and what the tests cover |
//! | [`layout`] | where each part of the source lives |
//!
//! The pages are documentation only: the module exists only when rustdoc
//! runs (`cfg(doc)`), and every Rust example on them is compiled as a doc
//! test (`cargo test --doc`).

#[doc = include_str!("command_line.md")]
pub mod command_line {}

#[doc = include_str!("loading.md")]
pub mod loading {}

#[doc = include_str!("generating.md")]
pub mod generating {}

#[doc = include_str!("sampling.md")]
pub mod sampling {}

#[doc = include_str!("sessions.md")]
pub mod sessions {}

#[doc = include_str!("rendering.md")]
pub mod rendering {}

#[doc = include_str!("batches.md")]
pub mod batches {}

#[doc = include_str!("chat.md")]
pub mod chat {}

#[doc = include_str!("constraints.md")]
pub mod constraints {}

#[doc = include_str!("text.md")]
pub mod text {}

#[doc = include_str!("errors.md")]
pub mod errors {}

#[doc = include_str!("c_api.md")]
pub mod c_api {}

#[doc = include_str!("environment.md")]
pub mod environment {}

#[doc = include_str!("how_it_runs.md")]
pub mod how_it_runs {}

#[doc = include_str!("metal.md")]
pub mod metal {}

#[doc = include_str!("speed.md")]
pub mod speed {}

#[doc = include_str!("testing.md")]
pub mod testing {}

#[doc = include_str!("layout.md")]
pub mod layout {}
