//! Every WGSL kernel against a CPU reference, on random non-zero inputs, at
//! several shapes (including ones that are not multiples of the workgroup or
//! subgroup size), in both reduction variants (subgroup and workgroup
//! memory). Outputs are poisoned with NaN before each run so an unwritten
//! element fails.

use half::f16;
use qwen3_wgpu::kernels::{self, Bind, Kernel, WG};
use qwen3_wgpu::{AdapterPolicy, Gpu};
use rand::{rngs::StdRng, Rng, SeedableRng};

const POISON: u32 = 0x7fc0_dead; // a NaN

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

fn poisoned(n_words: usize) -> Vec<u8> {
    bytemuck::cast_slice(&vec![POISON; n_words]).to_vec()
}

fn f32s(v: &[f32]) -> Vec<u8> {
    bytemuck::cast_slice(v).to_vec()
}

fn to_f32(b: &[u8]) -> Vec<f32> {
    bytemuck::pod_collect_to_vec(b)
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
    dispatch_grid(gpu, kernel, subgroups, uniforms, storage, kernels::grid(workgroups))
}

/// [`dispatch`] with an explicit (x, y, z) grid.
fn dispatch_grid(
    gpu: &Gpu,
    kernel: Kernel,
    subgroups: bool,
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
        &kernel.constants(),
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

fn assert_close(what: &str, got: &[f32], want: &[f64], scale: &[f64], rel: f64) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, ((g, w), s)) in got.iter().zip(want).zip(scale).enumerate() {
        let tol = rel * s.max(1e-6);
        assert!(
            g.is_finite() && ((*g as f64) - w).abs() <= tol,
            "{what}[{i}]: got {g}, want {w} (tolerance {tol})"
        );
    }
}

/// Random non-zero values in +-[0.05, 1].
fn nonzero(rng: &mut StdRng, n: usize) -> Vec<f32> {
    (0..n)
        .map(|_| {
            let v: f32 = rng.random_range(0.05..1.0);
            if rng.random_bool(0.5) {
                v
            } else {
                -v
            }
        })
        .collect()
}

struct Quant {
    padded: usize,
    q: Vec<i8>,
    scales: Vec<f32>,
}

fn random_quant(rng: &mut StdRng, rows: usize, cols: usize) -> Quant {
    let padded = cols.div_ceil(64) * 64;
    let groups = padded / 64;
    let mut q = vec![0i8; rows * padded];
    for r in 0..rows {
        for c in 0..cols {
            q[r * padded + c] = rng.random_range(-127..=127);
            if q[r * padded + c] == 0 {
                q[r * padded + c] = 1;
            }
        }
    }
    let scales = (0..rows * groups).map(|_| rng.random_range(0.001..0.02)).collect();
    Quant { padded, q, scales }
}

impl Quant {
    fn w(&self, r: usize, c: usize) -> f64 {
        self.q[r * self.padded + c] as f64 * self.scales[r * (self.padded / 64) + c / 64] as f64
    }
    fn data(&self) -> Vec<u8> {
        bytemuck::cast_slice(&self.q).to_vec()
    }
}

#[test]
fn int8_matvec_matches_cpu() {
    let gpu = gpu();
    let mut rng = StdRng::seed_from_u64(1);
    for sub in variants(&gpu) {
        for &(rows, cols) in &[(1, 64), (3, 96), (5, 1000), (67, 128), (130, 1024), (9, 3072)] {
            for kernel in Kernel::ALL.into_iter().filter(|k| k.matvec_variant().is_some()) {
                let variant = kernel.matvec_variant().unwrap();
                let accumulate = variant.accumulate;
                let m = random_quant(&mut rng, rows, cols);
                let mut x = nonzero(&mut rng, m.padded);
                x[cols..].iter_mut().for_each(|v| *v = 0.0); // padding stays zero
                                                             // The fused RMSNorm's weight, zero-padded like the engine's.
                let mut norm_w = nonzero(&mut rng, m.padded);
                norm_w[cols..].iter_mut().for_each(|v| *v = 0.0);
                let eps = 1e-6f32;
                // What the matrix multiplies: x, or rms_norm(x) * norm_w.
                let xe: Vec<f64> = if variant.norm {
                    let ms = x[..cols].iter().map(|v| (*v as f64).powi(2)).sum::<f64>() / cols as f64;
                    let inv = 1.0 / (ms + eps as f64).sqrt();
                    x.iter().zip(&norm_w).map(|(v, w)| *v as f64 * inv * *w as f64).collect()
                } else {
                    x.iter().map(|v| *v as f64).collect()
                };
                let row_offset = 3usize;
                let y0 = nonzero(&mut rng, rows + row_offset);
                let init = if accumulate { f32s(&y0) } else { poisoned(rows + row_offset) };
                let params = [
                    rows as u32,
                    (m.padded / 4) as u32,
                    (m.padded / 64) as u32,
                    row_offset as u32,
                    cols as u32,
                    eps.to_bits(),
                ];
                let out = dispatch(
                    &gpu,
                    kernel,
                    sub,
                    &[bytemuck::cast_slice(&params)],
                    &[f32s(&x), m.data(), f32s(&m.scales), init, f32s(&norm_w)],
                    (rows as u32).div_ceil(kernel.matvec_rows()),
                );
                let got = to_f32(&out[0]);
                // Elements before row_offset are untouched.
                for i in 0..row_offset {
                    if accumulate {
                        assert_eq!(got[i], y0[i]);
                    } else {
                        assert_eq!(got[i].to_bits(), POISON, "wrote before row_offset");
                    }
                }
                let mut want = Vec::new();
                let mut scale = Vec::new();
                for r in 0..rows {
                    let dot: f64 = (0..cols).map(|c| m.w(r, c) * xe[c]).sum();
                    let mag: f64 = (0..cols).map(|c| (m.w(r, c) * xe[c]).abs()).sum();
                    want.push(dot + if accumulate { y0[row_offset + r] as f64 } else { 0.0 });
                    scale.push(mag + 1.0);
                }
                assert_close(
                    &format!("{kernel:?} {rows}x{cols} sub={sub}"),
                    &got[row_offset..],
                    &want,
                    &scale,
                    1e-5,
                );
            }
        }
    }
}

#[test]
fn swiglu_matches_cpu() {
    let gpu = gpu();
    let mut rng = StdRng::seed_from_u64(3);
    for &n in &[1usize, 255, 257, 3072] {
        let gu: Vec<f32> = nonzero(&mut rng, 2 * n).iter().map(|v| v * 8.0).collect();
        let out = dispatch(
            &gpu,
            Kernel::Swiglu,
            false,
            &[bytemuck::bytes_of(&(n as u32))],
            &[f32s(&gu), poisoned(n)],
            (n as u32).div_ceil(WG),
        );
        let got = to_f32(&out[0]);
        let want: Vec<f64> = (0..n)
            .map(|i| {
                let g = gu[i] as f64;
                g / (1.0 + (-g).exp()) * gu[n + i] as f64
            })
            .collect();
        let scale: Vec<f64> = want.iter().map(|v| v.abs() + 1.0).collect();
        assert_close(&format!("swiglu {n}"), &got, &want, &scale, 1e-5);
    }
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
                padded: m.padded,
                q: m.q[row_start as usize * m.padded..row_end as usize * m.padded].to_vec(),
                scales: m.scales[row_start as usize * (m.padded / 64)..row_end as usize * (m.padded / 64)]
                    .to_vec(),
            };
            let params = [(m.padded / 4) as u32, (m.padded / 64) as u32, row_start, row_end];
            let out = dispatch(
                &gpu,
                Kernel::EmbedLookup,
                false,
                &[bytemuck::cast_slice(&params)],
                &[bytemuck::bytes_of(&token).to_vec(), chunk.data(), f32s(&chunk.scales), poisoned(m.padded)],
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
fn argmax_matches_cpu_with_lowest_index_on_ties() {
    let gpu = gpu();
    let mut rng = StdRng::seed_from_u64(5);
    for sub in variants(&gpu) {
        for &n in &[1usize, 7, 255, 1000, 151936] {
            for ties in [false, true] {
                let mut v = nonzero(&mut rng, n);
                let mut want = 0;
                for i in 0..n {
                    if v[i] > v[want] {
                        want = i;
                    }
                }
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
                let out = dispatch(
                    &gpu,
                    Kernel::ArgmaxFinal,
                    sub,
                    &[bytemuck::bytes_of(&parts)],
                    &[out[0].clone(), out[1].clone(), poisoned(1)],
                    1,
                );
                let got = u32::from_le_bytes(out[0][..4].try_into().unwrap());
                assert_eq!(got as usize, want, "argmax n={n} ties={ties} sub={sub}");
            }
        }
    }
}

fn rope_ref(v: &[f64], pos: usize, theta: f64) -> Vec<f64> {
    let d = v.len();
    let half = d / 2;
    let mut out = vec![0.0; d];
    for i in 0..half {
        let a = pos as f64 * theta.powf(-((2 * i) as f64) / d as f64);
        let (s, c) = a.sin_cos();
        out[i] = v[i] * c - v[i + half] * s;
        out[i + half] = v[i + half] * c + v[i] * s;
    }
    out
}

fn norm_ref(v: &[f32], w: &[f32], eps: f64) -> Vec<f64> {
    let ms: f64 = v.iter().map(|x| (*x as f64).powi(2)).sum::<f64>() / v.len() as f64;
    let inv = 1.0 / (ms + eps).sqrt();
    v.iter().zip(w).map(|(x, w)| *x as f64 * inv * *w as f64).collect()
}

fn unpack_f16(words: &[u8]) -> Vec<f32> {
    let h: Vec<u16> = bytemuck::pod_collect_to_vec(words);
    h.iter().map(|b| f16::from_bits(*b).to_f32()).collect()
}

#[test]
fn qk_norm_rope_matches_cpu() {
    let gpu = gpu();
    let mut rng = StdRng::seed_from_u64(6);
    for sub in variants(&gpu) {
        for &(nh, nkv, hd, cap, pos) in &[
            (4usize, 2usize, 64usize, 8usize, 5usize),
            (16, 8, 128, 40, 37),
            (3, 1, 32, 4, 0),
            (8, 8, 128, 3000, 2999),
        ] {
            let theta = 1_000_000f32;
            let eps = 1e-6f32;
            let qkv = nonzero(&mut rng, (nh + 2 * nkv) * hd);
            let qn = nonzero(&mut rng, hd);
            let kn = nonzero(&mut rng, hd);
            let params: [u32; 5] = [nh as u32, nkv as u32, hd as u32, cap as u32, eps.to_bits()];
            let rope = qwen3_wgpu::qwen3::rope_table(hd, cap, theta);
            let step = [pos as u32, pos as u32 + 1];
            let cache_words = nkv * cap * hd / 2;
            let out = dispatch(
                &gpu,
                Kernel::QkNormRope,
                sub,
                &[bytemuck::cast_slice(&params), bytemuck::cast_slice(&step)],
                &[
                    f32s(&qkv),
                    f32s(&qn),
                    f32s(&kn),
                    f32s(&rope),
                    poisoned(nh * hd),
                    poisoned(cache_words),
                    poisoned(cache_words),
                ],
                (nh + 2 * nkv) as u32,
            );
            let q = to_f32(&out[0]);
            let kc = unpack_f16(&out[1]);
            let vc = unpack_f16(&out[2]);
            for h in 0..nh {
                let want =
                    rope_ref(&norm_ref(&qkv[h * hd..(h + 1) * hd], &qn, eps as f64), pos, theta as f64);
                let scale: Vec<f64> = want.iter().map(|v| v.abs() + 1.0).collect();
                assert_close(&format!("q head {h} sub={sub}"), &q[h * hd..(h + 1) * hd], &want, &scale, 2e-4);
            }
            for g in 0..nkv {
                let src = (nh + g) * hd;
                let want = rope_ref(&norm_ref(&qkv[src..src + hd], &kn, eps as f64), pos, theta as f64);
                let at = (g * cap + pos) * hd;
                let scale: Vec<f64> = want.iter().map(|v| v.abs() + 1.0).collect();
                assert_close(&format!("k head {g}"), &kc[at..at + hd], &want, &scale, 2e-3);
                let vsrc = (nh + nkv + g) * hd;
                let vwant: Vec<f64> = qkv[vsrc..vsrc + hd].iter().map(|v| *v as f64).collect();
                assert_close(&format!("v head {g}"), &vc[at..at + hd], &vwant, &vec![1.0; hd], 1e-3);
                // Other positions stay untouched.
                let other = ((g * cap + (pos + 1) % cap) * hd) / 2;
                if cap > 1 {
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
        for &(nh, nkv, hd, cap, seq) in &[
            (4usize, 2usize, 64usize, 16usize, 1usize),
            (4, 1, 64, 300, 300),
            (16, 8, 128, 64, 33),
            (3, 3, 32, 600, 517),
            (2, 1, 128, 1100, 1025),
        ] {
            let q = nonzero(&mut rng, nh * hd);
            let kv_len = nkv * cap * hd;
            let k: Vec<f16> = nonzero(&mut rng, kv_len).iter().map(|v| f16::from_f32(*v)).collect();
            let v: Vec<f16> = nonzero(&mut rng, kv_len).iter().map(|v| f16::from_f32(*v)).collect();
            let scale_f = 1.0 / (hd as f32).sqrt();
            let params: [u32; 5] = [nh as u32, nkv as u32, hd as u32, cap as u32, scale_f.to_bits()];
            let step = [seq as u32 - 1, seq as u32];
            // Chunks past the context must contribute nothing: size the grid
            // for the capacity, as the engine does.
            let chunks = cap.div_ceil(kernels::ATTENTION_CHUNK as usize);
            let parts = dispatch_grid(
                &gpu,
                Kernel::AttentionPartial,
                sub,
                &[bytemuck::cast_slice(&params), bytemuck::cast_slice(&step)],
                &[
                    f32s(&q),
                    bytemuck::cast_slice(&k).to_vec(),
                    bytemuck::cast_slice(&v).to_vec(),
                    poisoned(2 * nh * chunks),
                    poisoned(nh * chunks * hd),
                ],
                [nh as u32, chunks as u32, 1],
            );
            let p2 = [hd as u32, chunks as u32];
            let out = dispatch(
                &gpu,
                Kernel::AttentionReduce,
                sub,
                &[bytemuck::cast_slice(&p2)],
                &[parts[0].clone(), parts[1].clone(), poisoned(nh * hd)],
                nh as u32,
            );
            let got = to_f32(&out[0]);
            for h in 0..nh {
                let g = h / (nh / nkv);
                let kv = |t: usize, d: usize, x: &[f16]| x[(g * cap + t) * hd + d].to_f64();
                let s: Vec<f64> = (0..seq)
                    .map(|t| {
                        (0..hd).map(|d| q[h * hd + d] as f64 * kv(t, d, &k)).sum::<f64>() * scale_f as f64
                    })
                    .collect();
                let m = s.iter().cloned().fold(f64::MIN, f64::max);
                let e: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
                let l: f64 = e.iter().sum();
                let want: Vec<f64> =
                    (0..hd).map(|d| (0..seq).map(|t| e[t] * kv(t, d, &v)).sum::<f64>() / l).collect();
                assert_close(
                    &format!("attention head {h} seq {seq} sub={sub}"),
                    &got[h * hd..(h + 1) * hd],
                    &want,
                    &vec![1.0; hd],
                    1e-4,
                );
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
        let c = k.constants();
        let gw = c.iter().find(|(n, _)| *n == "GROUP_WORDS").expect("GROUP_WORDS set").1;
        assert_eq!(gw as usize * 4, qwen3_wgpu::weights::QUANT_GROUP);
        assert!(k.wgsl().contains("override GROUP_WORDS"));
    }
}
