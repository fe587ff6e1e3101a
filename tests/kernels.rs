//! Every WGSL kernel against a CPU reference (tests/common/reference.rs,
//! shared with the MSL twins' tests), on random non-zero inputs, at several
//! shapes (including ones that are not multiples of the workgroup or
//! subgroup size), in both reduction variants (subgroup and workgroup
//! memory). Outputs are poisoned with NaN before each run so an unwritten
//! element fails.

mod common;

use common::reference::*;
use half::f16;
use qwen3_wgpu::kernels::{self, Bind, Kernel, MatvecLayout, WG};
use qwen3_wgpu::{AdapterPolicy, Gpu};
use rand::{rngs::StdRng, SeedableRng};

fn gpu() -> Gpu {
    Gpu::new(AdapterPolicy::Portable).expect("a Vulkan adapter (lavapipe in CI)")
}

fn variants(gpu: &Gpu) -> Vec<bool> {
    if gpu.device.features().contains(wgpu::Features::SUBGROUP) {
        vec![true, false]
    } else {
        vec![false]
    }
}

/// Runs `kernel` once: `uniforms` and `storage` fill the kernel's bindings
/// in order; returns the contents of every read_write buffer, in order.
fn dispatch(
    gpu: &Gpu,
    kernel: Kernel,
    subgroups: bool,
    uniforms: &[&[u8]],
    storage: &[Vec<u8>],
    workgroups: u32,
) -> Vec<Vec<u8>> {
    let layout = MatvecLayout::RowsPerTeam;
    dispatch_grid(gpu, kernel, subgroups, layout, uniforms, storage, kernels::grid(workgroups))
}

/// [`dispatch`] with an explicit matvec layout and (x, y, z) grid.
fn dispatch_grid(
    gpu: &Gpu,
    kernel: Kernel,
    subgroups: bool,
    layout: MatvecLayout,
    uniforms: &[&[u8]],
    storage: &[Vec<u8>],
    grid: [u32; 3],
) -> Vec<Vec<u8>> {
    dispatch_with(gpu, kernel, subgroups, &kernel.constants(layout), uniforms, storage, grid)
}

/// [`dispatch_grid`] with explicit override constants.
fn dispatch_with(
    gpu: &Gpu,
    kernel: Kernel,
    subgroups: bool,
    constants: &[(&str, f64)],
    uniforms: &[&[u8]],
    storage: &[Vec<u8>],
    grid: [u32; 3],
) -> Vec<Vec<u8>> {
    let (pipeline, layout) = kernels::compile(
        gpu,
        kernel.entry(),
        &kernel.source(subgroups),
        kernel.entry(),
        kernel.bindings(),
        constants,
    )
    .expect("kernel compiles");
    let (mut u, mut s) = (uniforms.iter(), storage.iter());
    let bufs: Vec<(Bind, wgpu::Buffer, usize)> = kernel
        .bindings()
        .iter()
        .map(|b| match b {
            Bind::Uniform => {
                let d = u.next().expect("enough uniforms");
                (*b, gpu.uniform("u", d).unwrap(), d.len())
            }
            _ => {
                let d = s.next().expect("enough storage buffers");
                (*b, gpu.storage_init("s", d).unwrap(), d.len())
            }
        })
        .collect();
    assert!(u.next().is_none() && s.next().is_none(), "binding count mismatch");
    let entries: Vec<_> = bufs
        .iter()
        .enumerate()
        .map(|(i, (_, b, _))| wgpu::BindGroupEntry { binding: i as u32, resource: b.as_entire_binding() })
        .collect();
    let bg = gpu.device.create_bind_group(&wgpu::BindGroupDescriptor {
        label: None,
        layout: &layout,
        entries: &entries,
    });
    let mut enc = gpu.device.create_command_encoder(&Default::default());
    {
        let mut pass = enc.begin_compute_pass(&Default::default());
        pass.set_pipeline(&pipeline);
        pass.set_bind_group(0, &bg, &[]);
        pass.dispatch_workgroups(grid[0], grid[1], grid[2]);
    }
    gpu.queue.submit([enc.finish()]);
    let out = bufs
        .iter()
        .filter(|(b, _, _)| *b == Bind::ReadWrite)
        .map(|(_, buf, len)| gpu.download(buf, *len).unwrap())
        .collect();
    gpu.check_fault().unwrap();
    out
}

#[test]
fn int8_matvec_matches_cpu() {
    let gpu = gpu();
    let mut rng = StdRng::seed_from_u64(1);
    for sub in variants(&gpu) {
        // Rows not a multiple of the 4 rows per team or the 8 per workgroup,
        // K not a multiple of a team's stride (lavapipe: 8 lanes x 16 values);
        // one token (decode) or a batch of 3 (prefill, grid z).
        // The prefill pipelines (PREFILL_TOKENS_PER_WG tokens per workgroup)
        // run whole groups of tokens: 8 or 16.
        let per_wg = kernels::PREFILL_TOKENS_PER_WG as usize;
        let shapes = [
            (2, 64, 1, false),
            (6, 96, 3, false),
            (10, 1000, 1, false),
            (66, 128, 3, false),
            (130, 1024, 1, false),
            (18, 3072, 3, false),
            (4, 2048, 1, false),
            (6, 96, per_wg, true),
            (66, 1000, 2 * per_wg, true),
        ];
        for &(rows, cols, tokens, prefill) in &shapes {
            let kernels = Kernel::ALL.into_iter().filter(|k| k.matvec_variant().is_some());
            let layouts = [MatvecLayout::RowsPerTeam, MatvecLayout::SplitK];
            for (kernel, layout) in kernels.flat_map(|k| layouts.map(|l| (k, l))) {
                let variant = kernel.matvec_variant().unwrap();
                let m = random_quant(&mut rng, rows, cols);
                let xs: Vec<Vec<f32>> = (0..tokens).map(|_| padded_input(&mut rng, cols)).collect();
                // The fused RMSNorm's weight, zero-padded like the engine's.
                let norm_w = padded_input(&mut rng, cols);
                let eps = 1e-6f32;
                // SWIGLU writes one output per row pair, from (row_offset / 2).
                let row_offset = if variant.swiglu { 4usize } else { 3 };
                let first_out = if variant.swiglu { row_offset / 2 } else { row_offset };
                let outs = if variant.swiglu { rows / 2 } else { rows };
                // Token z's outputs start at z * y_stride (a gap after each).
                let y_stride = first_out + outs + 5;
                let y0 = nonzero(&mut rng, tokens * y_stride);
                let init = if variant.accumulate { f32s(&y0) } else { poisoned(tokens * y_stride) };
                let params = [
                    rows as u32,
                    m.k_words() as u32,
                    m.groups() as u32,
                    row_offset as u32,
                    cols as u32,
                    eps.to_bits(),
                    y_stride as u32,
                ];
                let mut grid = kernels::grid((rows as u32).div_ceil(layout.rows_per_wg()));
                let constants =
                    if prefill { kernel.prefill_constants(layout) } else { kernel.constants(layout) };
                grid[2] = if prefill { (tokens / per_wg) as u32 } else { tokens as u32 };
                let out = dispatch_with(
                    &gpu,
                    kernel,
                    sub,
                    &constants,
                    &[bytemuck::cast_slice(&params)],
                    &[f32s(&xs.concat()), m.data(), f32s(&m.scales), init, f32s(&norm_w)],
                    grid,
                );
                let got = to_f32(&out[0]);
                for (z, x) in xs.iter().enumerate() {
                    let row = &got[z * y_stride..(z + 1) * y_stride];
                    let row0 = &y0[z * y_stride..(z + 1) * y_stride];
                    // Elements outside the outputs are untouched.
                    for i in (0..first_out).chain(first_out + outs..y_stride) {
                        if variant.accumulate {
                            assert_eq!(row[i], row0[i]);
                        } else {
                            assert_eq!(
                                row[i].to_bits(),
                                POISON,
                                "token {z}: wrote outside the outputs at {i}"
                            );
                        }
                    }
                    let norm = variant.norm.then_some((&norm_w[..], eps));
                    let acc = variant.accumulate.then_some(&row0[first_out..]);
                    let (want, scale) = matvec_ref(&m, x, norm, acc, variant.swiglu);
                    assert_close(
                        &format!("{kernel:?} {layout:?} {rows}x{cols} token {z}/{tokens} prefill={prefill} sub={sub}"),
                        &row[first_out..first_out + outs],
                        &want,
                        &scale,
                        1e-5,
                    );
                }
            }
        }
    }
}

/// `{pos, fill_end}`, the GPU-resident step state.
fn step(pos: usize, fill_end: usize) -> Vec<u8> {
    bytemuck::cast_slice(&[pos as u32, fill_end as u32]).to_vec()
}

#[test]
fn embed_lookup_matches_cpu() {
    let gpu = gpu();
    let mut rng = StdRng::seed_from_u64(4);
    for &(rows, cols) in &[(10usize, 64usize), (77, 96), (1000, 1024)] {
        let m = random_quant(&mut rng, rows, cols);
        for &(token, row_start, row_end) in
            &[(0u32, 0u32, rows as u32), (rows as u32 - 1, 0, rows as u32), (5, 4, 9), (9, 4, 9), (3, 4, 9)]
        {
            // The kernel binds a chunk: the table from row_start on.
            let chunk = Quant {
                rows: (row_end - row_start) as usize,
                cols,
                padded: m.padded,
                q: m.q[row_start as usize * m.padded..row_end as usize * m.padded].to_vec(),
                scales: m.scales[row_start as usize * m.groups()..row_end as usize * m.groups()].to_vec(),
            };
            let params = [m.k_words() as u32, m.groups() as u32, row_start, row_end];
            // The token is read at the GPU's position (2) of the sequence.
            let tokens = [7u32, 8, token, 9];
            let out = dispatch(
                &gpu,
                Kernel::EmbedLookup,
                false,
                &[bytemuck::cast_slice(&params)],
                &[
                    step(2, 3),
                    bytemuck::cast_slice(&tokens).to_vec(),
                    chunk.data(),
                    f32s(&chunk.scales),
                    poisoned(m.padded),
                ],
                (m.padded as u32 / 4).div_ceil(WG),
            );
            let got = to_f32(&out[0]);
            if token >= row_start && token < row_end {
                let want: Vec<f64> =
                    (0..m.padded).map(|c| if c < cols { m.w(token as usize, c) } else { 0.0 }).collect();
                let scale: Vec<f64> = want.iter().map(|v| v.abs() + 1e-3).collect();
                assert_close(&format!("embed {rows}x{cols} token {token}"), &got, &want, &scale, 1e-6);
            } else {
                assert!(got.iter().all(|v| v.to_bits() == POISON), "a chunk without the token wrote");
            }
        }
    }
}

#[test]
fn embed_lookup_batches_tokens_from_the_position() {
    let gpu = gpu();
    let mut rng = StdRng::seed_from_u64(14);
    let (rows, cols) = (40usize, 96usize);
    let m = random_quant(&mut rng, rows, cols);
    let tokens = [7u32, 8, 31, 0, 39, 5];
    let params = [m.k_words() as u32, m.groups() as u32, 0, rows as u32];
    let out = dispatch_grid(
        &gpu,
        Kernel::EmbedLookup,
        false,
        MatvecLayout::RowsPerTeam,
        &[bytemuck::cast_slice(&params)],
        &[
            step(2, 6),
            bytemuck::cast_slice(&tokens).to_vec(),
            m.data(),
            f32s(&m.scales),
            poisoned(3 * m.padded),
        ],
        [(m.padded as u32 / 4).div_ceil(WG), 1, 3],
    );
    let got = to_f32(&out[0]);
    for z in 0..3 {
        let t = tokens[2 + z] as usize;
        let want: Vec<f64> = (0..m.padded).map(|c| if c < cols { m.w(t, c) } else { 0.0 }).collect();
        let scale: Vec<f64> = want.iter().map(|v| v.abs() + 1e-3).collect();
        assert_close(
            &format!("batched embed token {z}"),
            &got[z * m.padded..(z + 1) * m.padded],
            &want,
            &scale,
            1e-6,
        );
    }
}

#[test]
fn argmax_matches_cpu_with_lowest_index_on_ties_and_advances_the_step() {
    let gpu = gpu();
    let mut rng = StdRng::seed_from_u64(5);
    for sub in variants(&gpu) {
        for &n in &[1usize, 7, 255, 1000, 151936] {
            for ties in [false, true] {
                let mut v = nonzero(&mut rng, n);
                let mut want = argmax_ref(&v);
                if ties && n > 3 {
                    // Plant the maximum at three places (in different chunks
                    // when n is large); the lowest must win.
                    let m = 5.0;
                    let (a, b, c) = (n - 1, n / 2, n / 3 + 1);
                    v[a] = m;
                    v[b] = m;
                    v[c] = m;
                    want = a.min(b).min(c);
                }
                let chunk = 1000u32; // not a multiple of the workgroup size
                let parts = (n as u32).div_ceil(chunk);
                let p = [n as u32, chunk];
                let out = dispatch(
                    &gpu,
                    Kernel::ArgmaxPartial,
                    sub,
                    &[bytemuck::cast_slice(&p)],
                    &[f32s(&v), poisoned(parts as usize), poisoned(parts as usize)],
                    parts,
                );
                // Position 3 of a 6-token sequence: the token goes to
                // tokens[4] unless position 4 still holds a prompt token.
                for (fill_end, writes) in [(4, true), (5, false)] {
                    let p = [parts, 6];
                    let fin = dispatch(
                        &gpu,
                        Kernel::ArgmaxFinal,
                        sub,
                        &[bytemuck::cast_slice(&p)],
                        &[out[0].clone(), out[1].clone(), poisoned(6), step(3, fill_end)],
                        1,
                    );
                    let tokens: Vec<u32> = bytemuck::pod_collect_to_vec(&fin[0]);
                    let st: Vec<u32> = bytemuck::pod_collect_to_vec(&fin[1]);
                    assert_eq!(st, [4, fill_end as u32], "position advances");
                    for (i, t) in tokens.iter().enumerate() {
                        if i == 4 && writes {
                            assert_eq!(*t as usize, want, "argmax n={n} ties={ties} sub={sub}");
                        } else {
                            assert_eq!(*t, POISON, "tokens[{i}] written (fill_end {fill_end})");
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn argmax_never_writes_past_the_token_array() {
    let gpu = gpu();
    let p = [1u32, 4];
    let out = dispatch(
        &gpu,
        Kernel::ArgmaxFinal,
        false,
        &[bytemuck::cast_slice(&p)],
        &[f32s(&[1.0]), bytemuck::bytes_of(&0u32).to_vec(), poisoned(5), step(3, 0)],
        1,
    );
    let tokens: Vec<u32> = bytemuck::pod_collect_to_vec(&out[0]);
    assert!(tokens.iter().all(|t| *t == POISON), "wrote past n_tokens: {tokens:?}");
}

#[test]
fn qk_norm_rope_matches_cpu() {
    let gpu = gpu();
    let mut rng = StdRng::seed_from_u64(6);
    for sub in variants(&gpu) {
        // (heads, kv heads, head_dim, capacity, first position, tokens)
        for &(nh, nkv, hd, cap, pos, tokens) in &[
            (4usize, 2usize, 64usize, 8usize, 5usize, 1usize),
            (16, 8, 128, 40, 37, 3), // a batch: positions 37, 38, 39
            (3, 1, 32, 4, 0, 1),
            (8, 8, 128, 3000, 2999, 1),
            (2, 1, 64, 4, 4, 1), // a step queued past the capacity writes nothing
        ] {
            let theta = 1_000_000f32;
            let eps = 1e-6f32;
            let rows = (nh + 2 * nkv) * hd;
            let qkv_stride = rows + 8; // padded rows, as the engine's
            let qkv = nonzero(&mut rng, tokens * qkv_stride);
            let qn = nonzero(&mut rng, hd);
            let kn = nonzero(&mut rng, hd);
            let params: [u32; 6] =
                [nh as u32, nkv as u32, hd as u32, cap as u32, eps.to_bits(), qkv_stride as u32];
            let rope = qwen3_wgpu::qwen3::rope_table(hd, cap, theta);
            let cache_words = nkv * cap * hd / 2;
            let out = dispatch_grid(
                &gpu,
                Kernel::QkNormRope,
                sub,
                MatvecLayout::RowsPerTeam,
                &[bytemuck::cast_slice(&params)],
                &[
                    step(pos, 0),
                    f32s(&qkv),
                    f32s(&qn),
                    f32s(&kn),
                    f32s(&rope),
                    poisoned(tokens * nh * hd),
                    poisoned(cache_words),
                    poisoned(cache_words),
                ],
                [(nh + 2 * nkv) as u32, 1, tokens as u32],
            );
            if pos >= cap {
                assert!(out.iter().flat_map(|o| to_f32(o)).all(|v| v.to_bits() == POISON));
                continue;
            }
            let q = to_f32(&out[0]);
            let kc = unpack_f16(&out[1]);
            let vc = unpack_f16(&out[2]);
            let (th, ep) = (theta as f64, eps as f64);
            for z in 0..tokens {
                let at_pos = pos + z;
                let head = |h: usize| &qkv[z * qkv_stride + h * hd..z * qkv_stride + (h + 1) * hd];
                for h in 0..nh {
                    let want = qk_norm_rope_ref(head(h), Some(&qn), at_pos, th, ep);
                    let scale: Vec<f64> = want.iter().map(|v| v.abs() + 1.0).collect();
                    let got = &q[(z * nh + h) * hd..(z * nh + h + 1) * hd];
                    assert_close(&format!("q head {h} token {z} sub={sub}"), got, &want, &scale, 2e-4);
                }
                for g in 0..nkv {
                    let want = qk_norm_rope_ref(head(nh + g), Some(&kn), at_pos, th, ep);
                    let at = (g * cap + at_pos) * hd;
                    let scale: Vec<f64> = want.iter().map(|v| v.abs() + 1.0).collect();
                    assert_close(&format!("k head {g} token {z}"), &kc[at..at + hd], &want, &scale, 2e-3);
                    let vwant = qk_norm_rope_ref(head(nh + nkv + g), None, at_pos, th, ep);
                    assert_close(
                        &format!("v head {g} token {z}"),
                        &vc[at..at + hd],
                        &vwant,
                        &vec![1.0; hd],
                        1e-3,
                    );
                }
            }
            // Positions outside the batch stay untouched.
            for g in 0..nkv {
                let other = ((g * cap + (pos + tokens) % cap) * hd) / 2;
                if cap > tokens {
                    let w = u32::from_le_bytes(out[1][4 * other..4 * other + 4].try_into().unwrap());
                    assert_eq!(w, POISON, "k cache written at another position");
                }
            }
        }
    }
}

#[test]
fn attention_matches_cpu() {
    let gpu = gpu();
    let mut rng = StdRng::seed_from_u64(7);
    for sub in variants(&gpu) {
        // (heads, kv heads, head_dim, capacity, context of the first token, tokens)
        for &(nh, nkv, hd, cap, seq, tokens) in &[
            (4usize, 2usize, 64usize, 16usize, 1usize, 1usize),
            (4, 1, 64, 300, 300, 1),
            (16, 8, 128, 64, 33, 1),
            (3, 3, 32, 600, 517, 1),
            (2, 1, 128, 1100, 1025, 1),
            (2, 1, 40, 300, 257, 1), // an odd number of 8-value K loads per row
            (3, 1, 8, 20, 13, 1),
            (4, 2, 64, 1100, 100, 1), // four chunks past the context (their acc stays poisoned)
            (4, 2, 64, 600, 250, 9),  // a causal batch: contexts 250..258, across a chunk edge
            (2, 2, 32, 16, 1, 5),     // a batch from the first position
        ] {
            let q = nonzero(&mut rng, tokens * nh * hd);
            let kv_len = nkv * cap * hd;
            let k: Vec<f16> = nonzero(&mut rng, kv_len).iter().map(|v| f16::from_f32(*v)).collect();
            let v: Vec<f16> = nonzero(&mut rng, kv_len).iter().map(|v| f16::from_f32(*v)).collect();
            let scale_f = 1.0 / (hd as f32).sqrt();
            let params: [u32; 5] = [nh as u32, nkv as u32, hd as u32, cap as u32, scale_f.to_bits()];
            // Chunks past the context must contribute nothing: size the grid
            // for the capacity, as the engine does.
            let chunks = cap.div_ceil(kernels::ATTENTION_CHUNK as usize);
            let parts = dispatch_grid(
                &gpu,
                Kernel::AttentionPartial,
                sub,
                MatvecLayout::RowsPerTeam,
                &[bytemuck::cast_slice(&params)],
                &[
                    step(seq - 1, 0),
                    f32s(&q),
                    bytemuck::cast_slice(&k).to_vec(),
                    bytemuck::cast_slice(&v).to_vec(),
                    poisoned(tokens * 2 * nh * chunks),
                    poisoned(tokens * nh * chunks * hd),
                ],
                [nh as u32, chunks as u32, tokens as u32],
            );
            let out_stride = nh * hd + 3; // padded rows, as the engine's
            let p2 = [hd as u32, chunks as u32, out_stride as u32];
            let out = dispatch_grid(
                &gpu,
                Kernel::AttentionReduce,
                sub,
                MatvecLayout::RowsPerTeam,
                &[bytemuck::cast_slice(&p2)],
                &[parts[0].clone(), parts[1].clone(), poisoned(tokens * out_stride)],
                [nh as u32, 1, tokens as u32],
            );
            let got = to_f32(&out[0]);
            for z in 0..tokens {
                let qz = &q[z * nh * hd..(z + 1) * nh * hd];
                let want = attention_ref(qz, &k, &v, nh, nkv, hd, cap, seq + z, scale_f as f64);
                let row = &got[z * out_stride..(z + 1) * out_stride];
                let what = format!("attention seq {} token {z}/{tokens} sub={sub}", seq + z);
                assert_close(&what, &row[..nh * hd], &want, &vec![1.0; nh * hd], 1e-4);
                assert!(row[nh * hd..].iter().all(|v| v.to_bits() == POISON), "{what}: wrote past the row");
            }
        }
    }
}

/// The WGSL of every kernel declares exactly the bindings the Rust table
/// lists (same indices, same address space and access).
#[test]
fn wgsl_bindings_match_the_kernel_table() {
    for k in Kernel::ALL {
        for sub in [true, false] {
            let module = naga::front::wgsl::parse_str(&k.source(sub)).expect("parses");
            let mut found: Vec<(u32, Bind)> = module
                .global_variables
                .iter()
                .filter_map(|(_, g)| {
                    let b = g.binding.as_ref()?;
                    assert_eq!(b.group, 0, "{}: only group 0 is used", k.entry());
                    let kind = match g.space {
                        naga::AddressSpace::Uniform => Bind::Uniform,
                        naga::AddressSpace::Storage { access }
                            if access.contains(naga::StorageAccess::STORE) =>
                        {
                            Bind::ReadWrite
                        }
                        naga::AddressSpace::Storage { .. } => Bind::Read,
                        other => panic!("{}: unexpected space {other:?}", k.entry()),
                    };
                    Some((b.binding, kind))
                })
                .collect();
            found.sort_by_key(|(i, _)| *i);
            let want: Vec<(u32, Bind)> =
                k.bindings().iter().enumerate().map(|(i, b)| (i as u32, *b)).collect();
            assert_eq!(found, want, "{}", k.entry());
        }
    }
}

/// The quant group size lives in weights.rs; the kernels get it as an override.
#[test]
fn group_size_reaches_the_kernels() {
    let users = Kernel::ALL.into_iter().filter(|k| k.matvec_variant().is_some() || *k == Kernel::EmbedLookup);
    for k in users {
        let c = k.constants(MatvecLayout::RowsPerTeam);
        let gw = c.iter().find(|(n, _)| *n == "GROUP_WORDS").expect("GROUP_WORDS set").1;
        assert_eq!(gw as usize * 4, qwen3_wgpu::weights::QUANT_GROUP);
        assert!(k.wgsl().contains("override GROUP_WORDS"));
    }
}
