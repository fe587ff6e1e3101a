// The decode state kept on the GPU (the session's `step` buffer, written by
// the host as [pos, fill_end] before a prompt or after dropping queued
// steps): argmax_final advances `pos`, so decode steps queue up without the
// host in the loop. Batched (prefill) launches read token z's position as
// pos + z.
struct Step {
    pos: u32,      // position of the token being processed
    fill_end: u32, // first position argmax_final may write a token to
}
