//! The MSL twins (kernels/msl/) executed on the CPU: each variant's source,
//! exactly as `msl::msl_source` gives it to Metal, is compiled as C++20
//! against tests/msl/metal_shim.h (one OS thread per lane, real barriers,
//! collective simdgroup functions) and run by tests/msl/harness.cpp on
//! random non-zero inputs with NaN-poisoned outputs, then compared with the
//! CPU references the WGSL kernels are tested against. Shapes: Qwen3-0.6B's
//! own, and awkward ones.

mod common;

use common::reference::{argmax_ref, attention_ref};
use common::{check_close, f32s, nonzero, poisoned, to_f32, to_u32, POISON};
use half::f16;
use qwen3_wgpu::kernels::{self, Bind, Kernel, ARGMAX_CHUNK, ATTENTION_CHUNK};
use qwen3_wgpu::msl;
use rand::{rngs::StdRng, SeedableRng};
use sha2::{Digest, Sha256};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// Kernels with an MSL twin (every variant of them).
fn twins() -> Vec<Kernel> {
    Kernel::ALL.into_iter().filter(|k| msl::msl_source(*k).is_some()).collect()
}

// ---------------------------------------------------------------------------
// The entry point's signature, parsed from the source.

/// One parameter of the entry point: its declared type, name and attribute
/// (`buffer(3)`, `thread_index_in_simdgroup`, ...).
#[derive(Debug)]
struct Param {
    ty: String,
    name: String,
    attr: String,
}

fn strip_comments(src: &str) -> String {
    let mut out = String::new();
    let mut rest = src;
    while !rest.is_empty() {
        if let Some(r) = rest.strip_prefix("//") {
            rest = r.find('\n').map_or("", |i| &r[i..]);
        } else if let Some(r) = rest.strip_prefix("/*") {
            rest = r.find("*/").map_or("", |i| &r[i + 2..]);
            out.push(' ');
        } else {
            let c = rest.chars().next().unwrap();
            out.push(c);
            rest = &rest[c.len_utf8()..];
        }
    }
    out
}

/// The parameters of `kernel void <entry>(...)` in `src`.
fn entry_params(src: &str, entry: &str) -> Vec<Param> {
    let src = strip_comments(src);
    let words: Vec<&str> = src.split_whitespace().collect();
    let decls = src.matches("kernel void").count();
    assert_eq!(decls, 1, "{entry}: one kernel function per file");
    let head = format!("kernel void {entry}");
    let at = src
        .find(&format!("{head}("))
        .or_else(|| src.find(&format!("{head} (")))
        .unwrap_or_else(|| panic!("no `{head}(` in the source ({} words)", words.len()));
    let open = at + src[at..].find('(').unwrap();
    let mut depth = 0;
    let mut parts = vec![String::new()];
    for c in src[open + 1..].chars() {
        match c {
            '(' | '[' => depth += 1,
            ')' | ']' if depth > 0 => depth -= 1,
            ')' => break,
            ',' if depth == 0 => {
                parts.push(String::new());
                continue;
            }
            _ => {}
        }
        parts.last_mut().unwrap().push(c);
    }
    parts
        .iter()
        .map(|p| {
            let p = p.trim();
            let a = p.find("[[").unwrap_or_else(|| panic!("{entry}: parameter `{p}` has no attribute"));
            let attr = p[a + 2..p.rfind("]]").expect("closing ]]")].trim().to_string();
            let decl = p[..a].trim();
            let split = decl.rfind(|c: char| !(c.is_alphanumeric() || c == '_')).expect("type and name");
            Param { ty: decl[..=split].trim().to_string(), name: decl[split + 1..].to_string(), attr }
        })
        .collect()
}

/// `Some(n)` for a `buffer(n)` attribute.
fn buffer_index(attr: &str) -> Option<u32> {
    let n = attr.strip_prefix("buffer(")?.strip_suffix(')')?;
    Some(n.trim().parse().expect("buffer index"))
}

/// How a buffer parameter is bound, from its address space.
fn bind_of(ty: &str) -> Option<Bind> {
    let t: Vec<&str> = ty.split_whitespace().collect();
    match t.as_slice() {
        ["constant", .., last] if last.ends_with('&') => Some(Bind::Uniform),
        ["const", "device", .., last] | ["device", "const", .., last] if last.ends_with('*') => {
            Some(Bind::Read)
        }
        ["device", .., last] if last.ends_with('*') => Some(Bind::ReadWrite),
        _ => None,
    }
}

// ---------------------------------------------------------------------------
// Build and run.

/// A C++ function calling the entry point with buffer n = `b[n]` and the
/// builtins from the lane's context (whose fields carry the attribute names).
fn launcher(params: &[Param], entry: &str) -> String {
    let args: Vec<String> = params
        .iter()
        .map(|p| match buffer_index(&p.attr) {
            Some(n) if p.ty.ends_with('&') => {
                format!("*static_cast<{}*>(b[{n}])", p.ty.trim_end_matches('&').trim())
            }
            Some(n) => format!("static_cast<{}>(b[{n}])", p.ty),
            None => format!("msl_rt::builtin<{}>(c.{})", p.ty, p.attr),
        })
        .collect();
    format!(
        "\nvoid msl_launch(void* const* b, const msl_rt::LaneCtx& c) {{\n    {entry}({});\n}}\n",
        args.join(",\n        ")
    )
}

/// Compiles `source` (a variant's full MSL) for `kernel` with extra `-D`
/// `defines`; returns the harness binary. Binaries are cached under the
/// target directory by a hash of everything that goes into them.
fn build(kernel: Kernel, source: &str, defines: &[&str]) -> PathBuf {
    let entry = msl::msl_entry(kernel);
    let unit = format!("{source}\n{}", launcher(&entry_params(source, entry), entry));
    let shim_dir = root().join("tests/msl");
    let mut args: Vec<String> = ["-std=c++20", "-O2", "-pthread", "-Wall", "-Wno-attributes", "-Wno-unused"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    args.extend(defines.iter().map(|d| format!("-D{d}")));
    let mut h = Sha256::new();
    for part in [&unit, &args.join(" ")] {
        h.update(part.as_bytes());
    }
    for f in ["metal_shim.h", "harness.cpp", "include/metal_stdlib"] {
        h.update(std::fs::read(shim_dir.join(f)).unwrap());
    }
    let key: String = h.finalize()[..8].iter().map(|b| format!("{b:02x}")).collect();
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("msl");
    std::fs::create_dir_all(&dir).unwrap();
    let bin = dir.join(format!("{entry}-{key}"));
    if bin.exists() {
        return bin;
    }
    // Unique temporary names: tests build in parallel, maybe the same unit.
    let tmp = format!("{entry}-{key}-{:?}", std::thread::current().id()).replace(['(', ')'], "");
    let cpp = dir.join(format!("{tmp}.cpp"));
    std::fs::write(&cpp, &unit).unwrap();
    let out = Command::new("g++")
        .args(&args)
        .arg(format!("-I{}", shim_dir.join("include").display()))
        .arg("-include")
        .arg(shim_dir.join("metal_shim.h"))
        .arg(&cpp)
        .arg(shim_dir.join("harness.cpp"))
        .arg("-o")
        .arg(dir.join(&tmp))
        .output()
        .expect("g++ runs (scripts/test.sh installs it)");
    assert!(
        out.status.success(),
        "g++ failed on {} ({kernel:?}):\n{}",
        cpp.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    std::fs::rename(dir.join(&tmp), &bin).unwrap();
    bin
}

/// The harness binary of `kernel`'s variant, unmodified.
fn built(kernel: Kernel) -> PathBuf {
    build(kernel, &msl::msl_source(kernel).expect("an MSL twin"), &[])
}

/// Runs `bin` over `grid` with `kernel`'s threadgroup size; `buffers` fill
/// the kernel's bindings in order. Returns the read_write buffers, in order.
fn run(bin: &Path, kernel: Kernel, grid: [u32; 3], buffers: &[Vec<u8>]) -> Vec<Vec<u8>> {
    let binds = kernel.bindings();
    assert_eq!(buffers.len(), binds.len(), "{kernel:?}: one buffer per binding");
    let outs: Vec<usize> = (0..binds.len()).filter(|i| binds[*i] == Bind::ReadWrite).collect();
    let mut child = Command::new(bin)
        .args(grid.iter().map(|g| g.to_string()))
        .arg(kernel.workgroup_size().to_string())
        .args(outs.iter().map(|i| i.to_string()))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("harness starts");
    let mut stdin = child.stdin.take().unwrap();
    let input: Vec<Vec<u8>> = buffers.to_vec();
    let writer = std::thread::spawn(move || {
        stdin.write_all(&(input.len() as u32).to_le_bytes())?;
        for b in &input {
            stdin.write_all(&(b.len() as u64).to_le_bytes())?;
            stdin.write_all(b)?;
        }
        Ok::<(), std::io::Error>(())
    });
    let mut stdout = Vec::new();
    child.stdout.take().unwrap().read_to_end(&mut stdout).unwrap();
    let mut stderr = String::new();
    child.stderr.take().unwrap().read_to_string(&mut stderr).unwrap();
    let status = child.wait().unwrap();
    let _ = writer.join();
    assert!(status.success(), "{kernel:?} harness failed ({status}) on grid {grid:?}:\n{stderr}");
    let mut res = Vec::new();
    let mut at = 0;
    for _ in &outs {
        let n = u64::from_le_bytes(stdout[at..at + 8].try_into().unwrap()) as usize;
        res.push(stdout[at + 8..at + 8 + n].to_vec());
        at += 8 + n;
    }
    assert_eq!(at, stdout.len(), "harness output length");
    res
}

// ---------------------------------------------------------------------------
// Sources and bindings.

/// Each twin's source is its preamble (one `#define` per override constant
/// of the kernel table) followed by the `.metal` file.
#[test]
fn msl_source_is_the_preamble_then_the_file() {
    for k in twins() {
        let pre = msl::preamble(k);
        assert_eq!(pre.lines().count(), k.constants().len(), "{k:?}");
        for (name, v) in k.constants() {
            assert!(pre.contains(&format!("#define {name} {}\n", v as i64)), "{k:?}: {name}");
        }
        assert!(pre.contains(&format!("#define WG {}\n", k.workgroup_size())));
        let src = msl::msl_source(k).unwrap();
        assert!(src.starts_with(&pre) && src.ends_with(msl::msl_file(k).unwrap()));
    }
}

/// Every twin's entry point declares exactly the kernel table's bindings at
/// wgpu's Metal slots (binding i of group 0 -> [[buffer(i)]], contiguous),
/// with the matching address space, and only builtins the shim provides.
#[test]
fn msl_bindings_match_the_kernel_table() {
    const BUILTINS: [&str; 10] = [
        "thread_position_in_threadgroup",
        "thread_index_in_threadgroup",
        "threadgroup_position_in_grid",
        "threadgroups_per_grid",
        "threads_per_threadgroup",
        "thread_position_in_grid",
        "thread_index_in_simdgroup",
        "simdgroup_index_in_threadgroup",
        "simdgroups_per_threadgroup",
        "threads_per_simdgroup",
    ];
    let mut seen = 0;
    for k in twins() {
        let entry = msl::msl_entry(k);
        assert_ne!(entry, "main", "MSL reserves main");
        let src = msl::msl_source(k).unwrap();
        let params = entry_params(&src, entry);
        let mut buffers: Vec<(u32, Bind)> = Vec::new();
        for p in &params {
            match buffer_index(&p.attr) {
                Some(n) => buffers.push((
                    n,
                    bind_of(&p.ty)
                        .unwrap_or_else(|| panic!("{entry}: `{}` has no known address space", p.ty)),
                )),
                None => assert!(
                    BUILTINS.contains(&p.attr.as_str()),
                    "{entry}: {} [[{}]] is neither a buffer nor a builtin the shim provides",
                    p.name,
                    p.attr
                ),
            }
        }
        let want: Vec<(u32, Bind)> = k.bindings().iter().enumerate().map(|(i, b)| (i as u32, *b)).collect();
        assert_eq!(buffers, want, "{entry} ({k:?}): buffers in declaration order");
        // Static threadgroup memory only (no [[threadgroup(n)]] parameters).
        assert!(!src.contains("[[threadgroup("), "{entry}: dynamic threadgroup memory");
        seen += 1;
    }
    assert!(seen >= 2, "twins found: {seen}");
}

#[test]
fn signature_parser_reads_address_spaces() {
    let src = "kernel void f(constant P& p [[buffer(0)]], const device float4* x [[buffer(1)]],\n\
               device uint* y [[ buffer(2) ]], // comment, with a comma\n uint3 wg [[threadgroup_position_in_grid]])";
    let p = entry_params(src, "f");
    assert_eq!(p.len(), 4);
    assert_eq!(
        p.iter().map(|p| bind_of(&p.ty)).collect::<Vec<_>>(),
        [Some(Bind::Uniform), Some(Bind::Read), Some(Bind::ReadWrite), None]
    );
    assert_eq!(
        p.iter().map(|p| buffer_index(&p.attr)).collect::<Vec<_>>(),
        [Some(0), Some(1), Some(2), None]
    );
    assert_eq!((p[3].ty.as_str(), p[3].name.as_str()), ("uint3", "wg"));
}

// ---------------------------------------------------------------------------
// Kernels.

/// argmax_partial's per-chunk (value, index) and, when it has a twin,
/// argmax_final's token, at the LM head's vocabulary and awkward sizes.
#[test]
fn msl_argmax_matches_cpu() {
    let partial = built(Kernel::ArgmaxPartial);
    let mut rng = StdRng::seed_from_u64(5);
    for &(n, chunk) in
        &[(1usize, 1000u32), (7, 1000), (555, 256), (1000, 1000), (151936, ARGMAX_CHUNK), (151936, 1000)]
    {
        for ties in [false, true] {
            let mut v = nonzero(&mut rng, n);
            if ties && n > 3 {
                // The maximum at three places (in different chunks when n is
                // large), and ties inside one chunk and one simdgroup.
                for i in [n - 1, n / 2, n / 3 + 1, n / 2 + 1, n / 2 + 33] {
                    if i < n {
                        v[i] = 5.0;
                    }
                }
            }
            let parts = (n as u32).div_ceil(chunk);
            let out = run(
                &partial,
                Kernel::ArgmaxPartial,
                kernels::grid(parts),
                &[
                    common::u32s(&[n as u32, chunk]),
                    f32s(&v),
                    poisoned(parts as usize),
                    poisoned(parts as usize),
                ],
            );
            let (val, idx) = (to_f32(&out[0]), to_u32(&out[1]));
            for c in 0..parts as usize {
                let lo = c * chunk as usize;
                let hi = n.min(lo + chunk as usize);
                let want = lo + argmax_ref(&v[lo..hi]);
                assert_eq!(idx[c] as usize, want, "argmax_partial n={n} chunk {c} ties={ties}");
                assert_eq!(val[c], v[want], "argmax_partial value n={n} chunk {c}");
            }
        }
    }
}

/// attention_reduce on chunk statistics computed on the CPU (including
/// empty chunks past the context), against the attention reference.
#[test]
fn msl_attention_reduce_matches_cpu() {
    let bin = built(Kernel::AttentionReduce);
    let mut rng = StdRng::seed_from_u64(8);
    let chunk = ATTENTION_CHUNK as usize;
    for &(nh, nkv, hd, cap, seq) in
        &[(16usize, 8usize, 128usize, 4096usize, 4000usize), (16, 8, 128, 300, 1), (3, 1, 64, 600, 517)]
    {
        let q = nonzero(&mut rng, nh * hd);
        let kv_len = nkv * cap * hd;
        let k: Vec<f64> = nonzero(&mut rng, kv_len).iter().map(|v| f16::from_f32(*v).to_f64()).collect();
        let v: Vec<f64> = nonzero(&mut rng, kv_len).iter().map(|v| f16::from_f32(*v).to_f64()).collect();
        let scale = 1.0 / (hd as f64).sqrt();
        let n_chunks = cap.div_ceil(chunk);
        let mut ml = Vec::new();
        let mut acc = Vec::new();
        for h in 0..nh {
            let g = h / (nh / nkv);
            for c in 0..n_chunks {
                let ts = c * chunk..seq.min((c + 1) * chunk);
                if ts.is_empty() {
                    ml.extend([-3.0e38f32, 0.0]);
                    acc.extend(std::iter::repeat_n(f32::from_bits(POISON), hd));
                    continue;
                }
                let s: Vec<f64> = ts
                    .clone()
                    .map(|t| {
                        (0..hd).map(|d| q[h * hd + d] as f64 * k[(g * cap + t) * hd + d]).sum::<f64>() * scale
                    })
                    .collect();
                let m = s.iter().cloned().fold(f64::MIN, f64::max);
                let e: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
                ml.extend([m as f32, e.iter().sum::<f64>() as f32]);
                acc.extend((0..hd).map(|d| {
                    ts.clone().zip(&e).map(|(t, e)| e * v[(g * cap + t) * hd + d]).sum::<f64>() as f32
                }));
            }
        }
        let out = run(
            &bin,
            Kernel::AttentionReduce,
            kernels::grid(nh as u32),
            &[common::u32s(&[hd as u32, n_chunks as u32]), f32s(&ml), f32s(&acc), poisoned(nh * hd)],
        );
        let want = attention_ref(&q, &k, &v, nh, nkv, hd, cap, seq, scale);
        let got = to_f32(&out[0]);
        common::assert_close(
            &format!("attention_reduce seq {seq}"),
            &got,
            &want,
            &vec![1.0; want.len()],
            1e-4,
        );
    }
}

// ---------------------------------------------------------------------------
// Teeth: the comparisons catch a broken kernel.

/// argmax_partial without its simdgroup maximum (each lane keeps its own)
/// must give wrong chunk winners.
#[test]
fn broken_argmax_is_caught() {
    let k = Kernel::ArgmaxPartial;
    let src = msl::msl_source(k).unwrap();
    let broken = src.replace("simd_max(best_v)", "best_v");
    assert_ne!(src, broken, "the substitution applies");
    let bin = build(k, &broken, &[]);
    let mut rng = StdRng::seed_from_u64(9);
    let n = 4096;
    let v = nonzero(&mut rng, n);
    let parts = 4u32;
    let out = run(
        &bin,
        k,
        kernels::grid(parts),
        &[common::u32s(&[n as u32, 1024]), f32s(&v), poisoned(parts as usize), poisoned(parts as usize)],
    );
    let idx = to_u32(&out[1]);
    let right = (0..parts as usize)
        .filter(|c| idx[*c] as usize == c * 1024 + argmax_ref(&v[c * 1024..(c + 1) * 1024]));
    assert!(right.count() < parts as usize, "a broken argmax passed");
    let _ = check_close; // used by the matvec teeth
}
