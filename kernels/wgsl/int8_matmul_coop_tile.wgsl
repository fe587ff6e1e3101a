// What int8_matmul_coop.wgsl and its emulation share: the tile's products
// in workgroup memory and the epilogue that stores them (ACCUMULATE,
// SWIGLU, the row bounds, through int8_matmul_common.wgsl's `store`).
// Prepended to both by Rust, after int8_matmul_common.wgsl.

// Two subgroups of 32 tokens per slice of k (COOP_KSPLIT, from Rust).
const COOP_WG: u32 = 64u * COOP_KSPLIT;
const_assert MM_ROWS == 64u && MM_TOKENS == 64u;

// c_s[t * MM_ROWS + r]: the tile's products (column-major).
var<workgroup> c_s: array<f32, MM_ROWS * MM_TOKENS>;

// Stores the tile of rows row0.. and tokens z * MM_TOKENS.. from c_s
// (written, and published by a barrier, before).
fn store_tile(l: u32, row0: u32, z: u32) {
    for (var e = l; e < MM_ROWS * MM_TOKENS; e += COOP_WG) {
        let r = e % MM_ROWS;
        let row = row0 + r;
        let t = z * MM_TOKENS + e / MM_ROWS;
        if SWIGLU {
            // Even rows are gates, each followed by its up row.
            if r % 2u == 0u && row + 1u < p.rows {
                store(row, t, c_s[e], c_s[e + 1u]);
            }
        } else if row < p.rows {
            store(row, t, c_s[e], 0.0);
        }
    }
}
