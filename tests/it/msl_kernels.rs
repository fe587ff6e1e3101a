//! The MSL twins (kernels/msl/) executed on the CPU: each variant's source,
//! exactly as `msl::msl_source` (and `MatmulConstants::msl_source` for the
//! prompt-batch `int8_matmul`) gives it to Metal, is compiled as C++20
//! against tests/msl/metal_shim.h (one OS thread per lane, real barriers,
//! collective simdgroup functions and SIMD-group matrices) and run by
//! tests/msl/harness.cpp on random non-zero inputs with NaN-poisoned
//! outputs, then compared with the CPU references the WGSL kernels are
//! tested against. Shapes: Qwen3-0.6B's own, and awkward ones. The shim's
//! SIMD-group matrices are themselves checked against plain matrix
//! products.

use crate::common;

use common::cases::{
    argmax_case, argmax_never_writes_past_the_token_array, argmax_partial_params, assert_matvec,
    attention_case, attention_case_int8, attention_case_rows, attention_reduce_case, attention_step_case,
    attention_step_case_int8, check_matrix_probe, matmul_case, matmul_case_for, matmul_case_half_exact,
    matrix_probe_inputs, matvec_case, matvec_case_in, qk_norm_rope_case, qk_norm_rope_case_int8,
    reduce_params, simdgroup_matrix_owner, to_u32, Mat, Sums, ATTENTION_INT8_SHAPES, ATTENTION_REDUCE_SHAPES,
    ATTENTION_SHAPES, ATTENTION_STEP_CHUNKED_SHAPES, ATTENTION_STEP_DIRECT_SHAPES,
    ATTENTION_STEP_INT8_SHAPES, MATRIX_PROBE, MATRIX_PROBE_BINDINGS, MATRIX_PROBE_THREADGROUP,
    QK_NORM_ROPE_INT8_SHAPES, QK_NORM_ROPE_SHAPES,
};
use common::reference::{argmax_ref, assert_close, f32s, nonzero, poisoned};
use qwen3_wgpu::internals::kernels::{self, Bind, Kernel, ARGMAX_CHUNK};
use qwen3_wgpu::internals::msl;
use qwen3_wgpu::WeightFormat;
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

/// Hex digest of `parts` and the shim's files (a cache key).
fn digest(parts: &[&str]) -> String {
    let mut h = Sha256::new();
    for p in parts {
        h.update(p.as_bytes());
        h.update([0]);
    }
    for f in ["metal_shim.h", "harness.cpp", "include/metal_stdlib"] {
        h.update(std::fs::read(root().join("tests/msl").join(f)).unwrap());
    }
    h.finalize()[..8].iter().map(|b| format!("{b:02x}")).collect()
}

/// Runs g++ with `args`, writing `out` (through a per-thread temporary name:
/// tests build in parallel, maybe the same file). Cached: an existing `out`
/// is kept.
fn gxx(args: &[String], out: &Path, what: &str) {
    if out.exists() {
        return;
    }
    let tmp = out.with_extension(format!("tmp{:?}", std::thread::current().id()).replace(['(', ')'], ""));
    let res = Command::new("g++")
        .args(args)
        .arg("-o")
        .arg(&tmp)
        .output()
        .expect("g++ runs (scripts/test.sh installs it)");
    assert!(res.status.success(), "g++ failed on {what}:\n{}", String::from_utf8_lossy(&res.stderr));
    std::fs::rename(&tmp, out).unwrap();
}

/// Compiles `source` (a variant's full MSL) for `kernel` with extra `-D`
/// `defines` into a harness binary. The kernel's translation unit is the
/// source then a generated launcher; the shim comes first (`-include`), and
/// the source's own `#include <metal_stdlib>` finds the shim's stand-in.
/// Objects and binaries are cached under the target directory by a hash of
/// everything that goes into them.
fn build(kernel: Kernel, source: &str, defines: &[&str]) -> PathBuf {
    build_entry(msl::msl_entry(kernel), source, defines)
}

/// [`build`] for the kernel function `entry` of `source`.
fn build_entry(entry: &str, source: &str, defines: &[&str]) -> PathBuf {
    let unit = format!("{source}\n{}", launcher(&entry_params(source, entry), entry));
    let shim_dir = root().join("tests/msl");
    let mut args: Vec<String> = ["-std=c++20", "-O2", "-pthread", "-Wall", "-Wno-attributes", "-Wno-unused"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    args.extend(defines.iter().map(|d| format!("-D{d}")));
    args.extend([
        format!("-I{}", shim_dir.join("include").display()),
        "-include".into(),
        shim_dir.join("metal_shim.h").display().to_string(),
    ]);
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("msl");
    std::fs::create_dir_all(&dir).unwrap();
    // The harness's main, once per set of flags.
    let harness = dir.join(format!("harness-{}.o", digest(&[&args.join(" ")])));
    let mut c = args.clone();
    c.extend(["-c".into(), shim_dir.join("harness.cpp").display().to_string()]);
    gxx(&c, &harness, "harness.cpp");

    let key = digest(&[&unit, &args.join(" ")]);
    let cpp = dir.join(format!("{entry}-{key}.cpp"));
    let bin = dir.join(format!("{entry}-{key}"));
    if !bin.exists() {
        // Replaced whole, never rewritten in place: another test may be compiling it.
        let tmp = cpp.with_extension(format!("{:?}", std::thread::current().id()).replace(['(', ')'], ""));
        std::fs::write(&tmp, &unit).unwrap();
        std::fs::rename(&tmp, &cpp).unwrap();
    }
    let mut l = args;
    l.extend([cpp.display().to_string(), harness.display().to_string()]);
    gxx(&l, &bin, &format!("{} ({entry})", cpp.display()));
    bin
}

/// A [`Run`] over the twins built with `defines` (each kernel's harness
/// binary is built on first use; builds are cached on disk).
fn msl_run<'a>(defines: &'a [&'a str]) -> impl Fn(Kernel, [u32; 3], &[Vec<u8>]) -> Vec<Vec<u8>> + 'a {
    msl_run_in(WeightFormat::Int8, defines)
}

/// [`msl_run`] with the matvecs over weights in `format`.
fn msl_run_in<'a>(
    format: WeightFormat,
    defines: &'a [&'a str],
) -> impl Fn(Kernel, [u32; 3], &[Vec<u8>]) -> Vec<Vec<u8>> + 'a {
    msl_run_edited(format, defines, |s| s.to_string())
}

/// [`msl_run_in`] with each source edited by `edit` first.
fn msl_run_edited<'a>(
    format: WeightFormat,
    defines: &'a [&'a str],
    edit: impl Fn(&str) -> String + 'a,
) -> impl Fn(Kernel, [u32; 3], &[Vec<u8>]) -> Vec<Vec<u8>> + 'a {
    move |k, grid, buffers| {
        let src = edit(&msl::msl_source_in(k, format).expect("an MSL twin"));
        run(&build(k, &src, defines), k, grid, buffers)
    }
}

/// A [`Run`] over the MSL twin of the tiled prompt-batch product
/// (`int8_matmul`) of each matvec variant, built with `defines`.
fn msl_matmul_run<'a>(defines: &'a [&'a str]) -> impl Fn(Kernel, [u32; 3], &[Vec<u8>]) -> Vec<Vec<u8>> + 'a {
    msl_matmul_run_edited(WeightFormat::Int8, defines, |s| s.to_string())
}

/// [`msl_matmul_run`] over weights in `format`, each source edited by
/// `edit` first.
fn msl_matmul_run_edited<'a>(
    format: WeightFormat,
    defines: &'a [&'a str],
    edit: impl Fn(&str) -> String + 'a,
) -> impl Fn(Kernel, [u32; 3], &[Vec<u8>]) -> Vec<Vec<u8>> + 'a {
    move |k, grid, buffers| {
        let bin = build_entry("int8_matmul", &edit(&matmul_msl_source_in(k, format)), defines);
        let launch = Launch { bindings: k.bindings(), threadgroup: kernels::MATMUL_MSL_WG, timeout_s: None };
        try_launch(&bin, &launch, grid, buffers).unwrap_or_else(|e| panic!("{k:?} (int8_matmul): {e}"))
    }
}

/// The MSL twin of `kernel`'s tiled prompt-batch product, as the engine
/// builds it.
fn matmul_msl_source(kernel: Kernel) -> String {
    matmul_msl_source_in(kernel, WeightFormat::Int8)
}

/// [`matmul_msl_source`] over weights in `format`.
fn matmul_msl_source_in(kernel: Kernel, format: WeightFormat) -> String {
    let c = kernel.matmul_constants().expect("a matvec variant");
    kernels::MatmulConstants { format, ..c }.msl_source()
}

/// Runs `bin` over `grid` with `kernel`'s threadgroup size; `buffers` fill
/// the kernel's bindings in order. Returns the read_write buffers, in order.
fn run(bin: &Path, kernel: Kernel, grid: [u32; 3], buffers: &[Vec<u8>]) -> Vec<Vec<u8>> {
    try_run(bin, kernel, grid, buffers).unwrap_or_else(|e| panic!("{e}"))
}

/// [`run`], or why the harness failed (a crash, a timeout).
fn try_run(bin: &Path, kernel: Kernel, grid: [u32; 3], buffers: &[Vec<u8>]) -> Result<Vec<Vec<u8>>, String> {
    let launch =
        Launch { bindings: kernel.bindings(), threadgroup: kernel.workgroup_size(), timeout_s: None };
    try_launch(bin, &launch, grid, buffers).map_err(|e| format!("{kernel:?} {e}"))
}

/// How a harness binary is launched: its entry point's bindings (in
/// order), the threadgroup size, and the harness's timeout (its default
/// when `None`).
struct Launch<'a> {
    bindings: &'a [Bind],
    threadgroup: u32,
    timeout_s: Option<u32>,
}

/// Runs `bin` over `grid` as `launch` says; `buffers` fill the bindings in
/// order. Returns the read_write buffers, in order, or why the harness
/// failed (a crash, a timeout).
fn try_launch(
    bin: &Path,
    launch: &Launch<'_>,
    grid: [u32; 3],
    buffers: &[Vec<u8>],
) -> Result<Vec<Vec<u8>>, String> {
    let binds = launch.bindings;
    assert_eq!(buffers.len(), binds.len(), "one buffer per binding");
    let outs: Vec<usize> = (0..binds.len()).filter(|i| binds[*i] == Bind::ReadWrite).collect();
    let mut command = Command::new(bin);
    if let Some(t) = launch.timeout_s {
        command.env("MSL_HARNESS_TIMEOUT", t.to_string());
    }
    let mut child = command
        .args(grid.iter().map(|g| g.to_string()))
        .arg(launch.threadgroup.to_string())
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
    if !status.success() {
        return Err(format!("harness failed ({status}) on grid {grid:?}:\n{stderr}"));
    }
    let mut res = Vec::new();
    let mut at = 0;
    for _ in &outs {
        let n = u64::from_le_bytes(stdout[at..at + 8].try_into().unwrap()) as usize;
        res.push(stdout[at + 8..at + 8 + n].to_vec());
        at += 8 + n;
    }
    assert_eq!(at, stdout.len(), "harness output length");
    Ok(res)
}

// ---------------------------------------------------------------------------
// Sources and bindings.

/// Each twin's source is its preamble (the `<metal_stdlib>` include, then
/// one prefixed `#define` per override constant of the kernel table)
/// followed by the `.metal` file.
#[test]
fn msl_source_is_the_preamble_then_the_file() {
    for k in twins() {
        let pre = msl::preamble(k);
        let defines = pre.strip_prefix(msl::MSL_HEADER).expect("the preamble starts with the header");
        assert_eq!(defines.lines().count(), k.constants(msl::MSL_MATVEC_LAYOUT).len(), "{k:?}");
        for (name, v) in k.constants(msl::MSL_MATVEC_LAYOUT) {
            assert!(defines.contains(&format!("#define Q3W_{name} {}\n", v as i64)), "{k:?}: {name}");
        }
        assert!(pre.contains(&format!("#define Q3W_WG {}\n", k.workgroup_size())));
        let src = msl::msl_source(k).unwrap();
        assert!(src.starts_with(&pre) && src.ends_with(msl::msl_file(k).unwrap()));
        // Over int4 weights: a matvec's preamble says so; the other
        // kernels read no weights and have one source.
        let int4 = msl::msl_source_in(k, WeightFormat::Int4).unwrap();
        if k.matvec_variant().is_some() {
            assert!(src.contains("#define Q3W_INT4 0\n"), "{k:?}");
            assert_eq!(int4, src.replace("#define Q3W_INT4 0\n", "#define Q3W_INT4 1\n"), "{k:?}");
        } else {
            assert_eq!(int4, src, "{k:?}");
        }
    }
}

/// Whether `word` occurs in `text` as a whole identifier.
fn has_identifier(text: &str, word: &str) -> bool {
    let ident = |c: char| c.is_ascii_alphanumeric() || c == '_';
    text.match_indices(word).any(|(i, _)| {
        !text[..i].chars().next_back().is_some_and(ident)
            && !text[i + word.len()..].chars().next().is_some_and(ident)
    })
}

/// Apple's headers are parsed before any generated macro exists, and no
/// generated macro can shadow a name of theirs: in every variant's source
/// (as the engine compiles it), `#include <metal_stdlib>` and `using
/// namespace metal;` precede the first `#define`, every `#define` names a
/// `Q3W_` macro, the `.metal` file includes nothing itself, and it uses no
/// generated constant by its bare name (`WG`, `NORM`, ...).
#[test]
fn msl_includes_precede_the_prefixed_defines() {
    let bare: std::collections::BTreeSet<&str> = Kernel::ALL
        .into_iter()
        .flat_map(|k| {
            let mut c = k.constants(msl::MSL_MATVEC_LAYOUT);
            c.extend(k.prefill_constants(msl::MSL_MATVEC_LAYOUT));
            c.into_iter().map(|(name, _)| name)
        })
        .collect();
    assert!(bare.contains("WG") && bare.contains("NORM") && bare.contains("TOKENS"));
    assert!(has_identifier("a[WG]", "WG") && !has_identifier("a[Q3W_WG]", "WG"));
    for k in twins() {
        let src = msl::msl_source(k).unwrap();
        let include = src.find("#include <metal_stdlib>").unwrap_or_else(|| panic!("{k:?}: no include"));
        let using = src.find("using namespace metal;").unwrap_or_else(|| panic!("{k:?}: no using"));
        let first_define = src.find("#define").unwrap_or(src.len());
        assert!(include < using && using < first_define, "{k:?}: a #define precedes the include");
        for line in src.lines().filter(|l| l.trim_start().starts_with("#define")) {
            let name = line.split_whitespace().nth(1).unwrap_or_default();
            assert!(name.starts_with(msl::MACRO_PREFIX), "{k:?}: unprefixed macro in `{line}`");
        }
        let body = strip_comments(msl::msl_file(k).unwrap());
        assert!(!body.contains("#include"), "{k:?}: the .metal file includes a header itself");
        for name in &bare {
            assert!(!has_identifier(&body, name), "{k:?}: the body uses the bare name {name}");
        }
    }
}

/// Every twin's entry point declares exactly the kernel table's bindings at
/// wgpu's Metal slots (binding i of group 0 -> [[buffer(i)]], contiguous),
/// with the matching address space, and only builtins the shim provides.
/// The builtins the shim provides (tests/msl/metal_shim.h `LaneCtx`).
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

/// `entry` in `src` declares exactly `bindings` at wgpu's Metal slots
/// (binding i of group 0 -> [[buffer(i)]], contiguous) with the matching
/// address space, only builtins the shim provides, and static threadgroup
/// memory only.
fn assert_entry_bindings(src: &str, entry: &str, bindings: &[Bind], what: &str) {
    assert_ne!(entry, "main", "MSL reserves main");
    let params = entry_params(src, entry);
    let mut buffers: Vec<(u32, Bind)> = Vec::new();
    for p in &params {
        match buffer_index(&p.attr) {
            Some(n) => buffers.push((
                n,
                bind_of(&p.ty).unwrap_or_else(|| panic!("{entry}: `{}` has no known address space", p.ty)),
            )),
            None => assert!(
                BUILTINS.contains(&p.attr.as_str()),
                "{entry}: {} [[{}]] is neither a buffer nor a builtin the shim provides",
                p.name,
                p.attr
            ),
        }
    }
    let want: Vec<(u32, Bind)> = bindings.iter().enumerate().map(|(i, b)| (i as u32, *b)).collect();
    assert_eq!(buffers, want, "{entry} ({what}): buffers in declaration order");
    // Static threadgroup memory only (no [[threadgroup(n)]] parameters).
    assert!(!src.contains("[[threadgroup("), "{entry}: dynamic threadgroup memory");
}

#[test]
fn msl_bindings_match_the_kernel_table() {
    let mut seen = 0;
    for k in twins() {
        let entry = msl::msl_entry(k);
        for format in WeightFormat::ALL {
            let src = msl::msl_source_in(k, format).unwrap();
            assert_entry_bindings(&src, entry, k.bindings(), &format!("{k:?} {format:?}"));
        }
        seen += 1;
    }
    assert!(seen >= 2, "twins found: {seen}");
}

/// The `int8_matmul` twin of each matvec variant: the preamble of its
/// constants (after the include, every macro prefixed), the generated
/// params once, then the file, which uses no bare constant name; the entry
/// point takes the matvec's bind-group layout, the one the WGSL
/// `int8_matmul` shares.
#[test]
fn msl_matmul_source_and_bindings_match_the_wgsl_product() {
    let variants: Vec<Kernel> = Kernel::ALL.into_iter().filter(|k| k.matvec_variant().is_some()).collect();
    assert_eq!(variants.len(), 3);
    let body = kernels::matmul::MATMUL_MSL;
    for (k, format) in variants.into_iter().flat_map(|k| WeightFormat::ALL.map(|f| (k, f))) {
        let c = kernels::MatmulConstants { format, ..k.matmul_constants().unwrap() };
        let src = c.msl_source();
        let int4 = (format == WeightFormat::Int4) as u32;
        assert!(src.contains(&format!("#define Q3W_INT4 {int4}\n")), "{k:?} {format:?}");
        let pre = msl::preamble_of(&c.msl_constants());
        assert!(src.starts_with(&pre) && src.ends_with(body), "{k:?}");
        let defines = pre.strip_prefix(msl::MSL_HEADER).expect("the preamble starts with the header");
        for (name, v) in c.msl_constants() {
            assert!(defines.contains(&format!("#define Q3W_{name} {}\n", v as i64)), "{k:?}: {name}");
            assert!(
                !has_identifier(&strip_comments(body), name),
                "{k:?}: the body uses the bare name {name}"
            );
        }
        assert!(defines.contains(&format!("#define Q3W_WG {}\n", kernels::MATMUL_MSL_WG)));
        assert!(defines.contains(&format!("#define Q3W_MM_TOKENS {}\n", k.matmul_tokens_per_wg())));
        assert_eq!(src.matches("struct Params {").count(), 1, "{k:?}");
        assert_entry_bindings(&src, "int8_matmul", k.bindings(), &format!("{k:?} int8_matmul"));
    }
    assert!(!strip_comments(body).contains("#include"), "the .metal file includes a header itself");
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

/// Every matvec variant at awkward shapes (rows not a multiple of 4, 8 or
/// 32; K not a multiple of a simdgroup's 512-value stride), one token
/// (decode) or a batch of 3 (prefill, grid z), and each at the Qwen3-0.6B
/// shapes the engine launches it with but the LM head's, the normed
/// variant over 1,024 inputs as qkv (its 151,936 rows only multiply the
/// shim's threadgroups, each a set of threads stepping the twin's xor
/// tree together: minutes of CI, where a Mac runs it in
/// metal_kernels.rs).
#[test]
fn msl_int8_matvec_matches_cpu() {
    let run = msl_run(&[]);
    let rows_per_wg = msl::MSL_MATVEC_LAYOUT.rows_per_wg();
    let mut seed = 1;
    for kernel in Kernel::ALL.into_iter().filter(|k| k.matvec_variant().is_some()) {
        let v = kernel.matvec_variant().unwrap();
        // (rows, cols, tokens)
        let mut shapes = vec![
            (2usize, 64usize, 1usize),
            (6, 96, 3),
            (10, 1000, 1),
            (66, 128, 3),
            (130, 1024, 1),
            (18, 3072, 3),
            (4, 2048, 1),
            (34, 704, 3),
        ];
        shapes.extend(match (v.accumulate, v.norm, v.swiglu) {
            (true, _, _) => vec![(1024, 2048, 1), (1024, 3072, 2)], // o_proj, down_proj
            (_, true, true) => vec![(6144, 1024, 2)],               // gate/up, interleaved
            _ => vec![(4096, 1024, 2)],                             // qkv
        });
        for (rows, cols, tokens) in shapes {
            seed += 1;
            let res = matvec_case(&run, kernel, rows_per_wg, 1, rows, cols, tokens, seed);
            assert_matvec(&format!("MSL {kernel:?} {rows}x{cols}"), &res);
        }
    }
}

/// Every matvec variant over int4 weights at awkward shapes: rows not a
/// multiple of 4, 8 or 32; K a multiple of the 64-value quant group but
/// not of a simdgroup's 1,024-value stride (one 32-value step per lane and
/// pass: fewer steps than lanes, and a pass or more plus a few); inputs
/// not a multiple of the group (a padded tail); one token (decode) or a
/// batch of 3 (prompt batches and a batch's decode rows, grid z, each row
/// the one-token code); and Qwen3-0.6B's layer shapes.
#[test]
fn msl_int4_matvec_matches_cpu() {
    let run = msl_run_in(WeightFormat::Int4, &[]);
    let rows_per_wg = msl::MSL_MATVEC_LAYOUT.rows_per_wg();
    let mut seed = 500;
    for kernel in Kernel::ALL.into_iter().filter(|k| k.matvec_variant().is_some()) {
        let v = kernel.matvec_variant().unwrap();
        // (rows, cols, tokens)
        let mut shapes = vec![
            (2usize, 64usize, 1usize),
            (6, 96, 3),
            (10, 1000, 1),
            (14, 64 * 17, 3),
            (66, 192, 1),
            (130, 64 * 33, 3),
            (18, 3000, 1),
            (34, 704, 3),
        ];
        shapes.extend(match (v.accumulate, v.norm, v.swiglu) {
            (true, _, _) => vec![(1024, 2048, 1), (1024, 3072, 2)], // o_proj, down_proj
            (_, true, true) => vec![(6144, 1024, 2)],               // gate/up, interleaved
            _ => vec![(4096, 1024, 2)],                             // qkv
        });
        for (rows, cols, tokens) in shapes {
            seed += 1;
            let res = matvec_case_in(
                &run,
                kernel,
                WeightFormat::Int4,
                false,
                rows_per_wg,
                1,
                rows,
                cols,
                tokens,
                seed,
            );
            assert_matvec(&format!("MSL int4 {kernel:?} {rows}x{cols} x{tokens}"), &res);
        }
    }
}

/// At the vocabulary size and awkward ones (not multiples of the chunk, the
/// threadgroup or the simdgroup).
#[test]
fn msl_argmax_matches_cpu_with_lowest_index_on_ties_and_advances_the_step() {
    let run = msl_run(&[]);
    let mut rng = StdRng::seed_from_u64(5);
    for &(n, chunk) in
        &[(1usize, 1000u32), (7, 1000), (555, 256), (1000, 1000), (151936, ARGMAX_CHUNK), (151936, 1000)]
    {
        for ties in [false, true] {
            argmax_case(&run, n, chunk, ties, &mut rng);
        }
    }
    argmax_never_writes_past_the_token_array(&run);
}

/// Qwen3-0.6B's heads at the first and a late position, and awkward shapes
/// (head_dim 32 and 64, one kv head); batches of tokens (grid z) at
/// consecutive positions, one of them running past the capacity.
#[test]
fn msl_qk_norm_rope_matches_cpu() {
    let run = msl_run(&[]);
    let mut rng = StdRng::seed_from_u64(6);
    // Qwen3-0.6B (heads, kv heads, head_dim, capacity, first position,
    // tokens), then the shared awkward shapes.
    let qwen = [(16, 8, 128, 4096, 3999, 1), (16, 8, 128, 4096, 0, 1), (16, 8, 128, 4096, 100, 4)];
    for shape in qwen.into_iter().chain(QK_NORM_ROPE_SHAPES) {
        qk_norm_rope_case(&run, shape, &mut rng);
    }
}

/// Contexts 1, 300 and 4000 of Qwen3-0.6B, and awkward shapes (contexts not
/// a multiple of the 256-position chunk or of 32, head_dim 32 and 64);
/// causal batches (grid z) across a chunk edge and from the first position.
#[test]
fn msl_attention_matches_cpu() {
    let run = msl_run(&[]);
    let mut rng = StdRng::seed_from_u64(7);
    // Qwen3-0.6B (heads, kv heads, head_dim, capacity, context of the first
    // token, tokens), then the shared awkward shapes.
    let qwen = [
        (16, 8, 128, 4096, 1, 1),
        (16, 8, 128, 4096, 300, 1),
        (16, 8, 128, 4096, 4000, 1),
        (16, 8, 128, 4096, 255, 3), // a batch: contexts 255..257, across a chunk edge
    ];
    for shape in qwen.into_iter().chain(ATTENTION_SHAPES) {
        attention_case(&run, shape, &mut rng);
    }
}

/// attention_reduce's twin alone on the shared reduce cases.
/// The MSL twin of attention_prefill's tile program (8x8 SIMD-group
/// matrices over an f16 cache) on the tile program's cases: each token
/// against the CPU reference (q exact in half), its partial results
/// poisoned; contexts across a chunk edge and 8-position blocks, a chunk
/// that ends at a capacity inside a block (the last KV head's rows past it
/// lie past the buffer), head_dims of 5 to 16 blocks (40: no multiple of 16).
#[test]
fn msl_attention_prefill_tiles_match_cpu() {
    let source = kernels::attention_prefill_tiles_msl_source();
    let k = Kernel::AttentionPartial;
    assert_entry_bindings(&source, "attention_prefill_tiles", k.bindings(), "attention_prefill_tiles");
    let bin = build_entry("attention_prefill_tiles", &source, &[]);
    let plain = msl_run(&[]);
    let per_wg = kernels::PREFILL_TILE_ATTENTION_TOKENS;
    let run = |k: Kernel, grid: [u32; 3], buffers: &[Vec<u8>]| {
        if k != Kernel::AttentionPartial {
            return plain(k, grid, buffers);
        }
        let launch = Launch { bindings: k.bindings(), threadgroup: k.workgroup_size(), timeout_s: None };
        let grid = [grid[0], grid[1], grid[2].div_ceil(per_wg)];
        try_launch(&bin, &launch, grid, buffers).unwrap_or_else(|e| panic!("attention_prefill_tiles: {e}"))
    };
    let mut rng = StdRng::seed_from_u64(33);
    for shape in
        [(4, 1, 64, 600, 240, 21), (6, 3, 40, 40, 1, 19), (2, 1, 64, 300, 283, 17), (2, 2, 128, 520, 500, 13)]
    {
        attention_case_rows(&run, shape, per_wg as usize, Sums::F16_TILES, &mut rng);
    }
}

#[test]
fn msl_attention_reduce_matches_cpu() {
    let run = msl_run(&[]);
    let mut rng = StdRng::seed_from_u64(17);
    for shape in ATTENTION_REDUCE_SHAPES {
        attention_reduce_case(&run, shape, &mut rng);
    }
}

/// A decode step's attention with the q/k norm, RoPE and cache write folded
/// in: Qwen3-0.6B at positions 0, 255 (one chunk, output written directly),
/// 256 and 4000 (chunks, then the reduce), and awkward shapes.
#[test]
fn msl_attention_step_matches_cpu() {
    let run = msl_run(&[]);
    let mut rng = StdRng::seed_from_u64(11);
    // Qwen3-0.6B (heads, kv heads, head_dim, capacity, position), then the
    // shared awkward shapes.
    for shape in
        [(16, 8, 128, 4096, 0), (16, 8, 128, 4096, 255)].into_iter().chain(ATTENTION_STEP_DIRECT_SHAPES)
    {
        attention_step_case(&run, Kernel::AttentionStepDirect, shape, &mut rng);
    }
    for shape in
        [(16, 8, 128, 4096, 256), (16, 8, 128, 4096, 4000)].into_iter().chain(ATTENTION_STEP_CHUNKED_SHAPES)
    {
        attention_step_case(&run, Kernel::AttentionStep, shape, &mut rng);
    }
}

/// The attention twin built `PACKED` (two query heads a threadgroup; the
/// cases' uniform packs from position 0): the chunked and direct decode
/// steps and the prompt variant against the CPU, Qwen3-0.6B's heads at
/// 4,000 positions among them; and a chunked step's caches, (m, l) and sums
/// bit for bit those of the unpacked twin.
#[test]
fn msl_attention_packed_matches_cpu_and_the_unpacked_twin() {
    let unpacked_source = msl::msl_source_in(Kernel::AttentionStep, WeightFormat::Int8).unwrap();
    assert!(unpacked_source.contains("#define Q3W_PACKED 0"), "the constant is in the preamble");
    let run = msl_run_edited(WeightFormat::Int8, &[], |s| {
        s.replace("#define Q3W_PACKED 0", "#define Q3W_PACKED 1")
    });
    let mut rng = StdRng::seed_from_u64(13);
    for shape in [(16, 8, 128, 4096, 4000)].into_iter().chain(ATTENTION_STEP_CHUNKED_SHAPES) {
        attention_step_case(&run, Kernel::AttentionStep, shape, &mut rng);
    }
    for shape in ATTENTION_STEP_DIRECT_SHAPES {
        attention_step_case(&run, Kernel::AttentionStepDirect, shape, &mut rng);
    }
    attention_case(&run, (16, 8, 128, 600, 300, 2), &mut rng);

    let unpacked = msl_run(&[]);
    let (nh, nkv, hd, cap, pos) = (4usize, 2usize, 64usize, 600usize, 513usize);
    let chunks = cap.div_ceil(kernels::ATTENTION_CHUNK as usize);
    let params = common::cases::attention_params((nh, nkv, hd, cap), (nh + 2 * nkv) * hd + 8, 0);
    let f16s = |v: Vec<f32>| -> Vec<u8> {
        let h: Vec<half::f16> = v.into_iter().map(half::f16::from_f32).collect();
        bytemuck::cast_slice(&h).to_vec()
    };
    let buffers = [
        bytemuck::bytes_of(&params).to_vec(),
        common::cases::step(pos, 0),
        f32s(&nonzero(&mut rng, params.qkv_stride as usize)),
        f16s(nonzero(&mut rng, nkv * cap * hd)),
        f16s(nonzero(&mut rng, nkv * cap * hd)),
        poisoned(2 * nh * chunks),
        poisoned(nh * chunks * hd),
        f32s(&nonzero(&mut rng, 2 * hd)),
        f32s(&qwen3_wgpu::internals::qwen3::rope_table(hd, cap, 1_000_000.0)),
    ];
    let grid = kernels::attention::partial_grid(nh as u32, chunks as u32);
    let (a, b) =
        (run(Kernel::AttentionStep, grid, &buffers), unpacked(Kernel::AttentionStep, grid, &buffers));
    for (i, name) in ["k_cache", "v_cache", "(m, l)", "sums"].iter().enumerate() {
        assert!(a[i] == b[i], "packed twin: {name} differs from the unpacked twin's");
    }
}

/// The twins over an int8 KV cache (`Q3W_KV_INT8`, the WGSL's int8 shapes): qk_norm_rope's int8 rows and scales,
/// and attention_partial's prompt variant and direct and chunked decode
/// steps (which write the new position's int8 rows and scales), unpacked
/// and packed, against the CPU.
#[test]
fn msl_kernels_over_an_int8_kv_cache_match_cpu() {
    for k in [Kernel::QkNormRope, Kernel::AttentionStep] {
        let src = msl::msl_source_in(k, WeightFormat::Int8).unwrap();
        assert!(src.contains("#define Q3W_KV_INT8 0"), "{k:?}: the constant is in the preamble");
    }
    let int8 = |s: &str| s.replace("#define Q3W_KV_INT8 0", "#define Q3W_KV_INT8 1");
    let mut rng = StdRng::seed_from_u64(31);
    let run = msl_run_edited(WeightFormat::Int8, &[], int8);
    for shape in QK_NORM_ROPE_INT8_SHAPES {
        qk_norm_rope_case_int8(&run, shape, &mut rng);
    }
    let packed = msl_run_edited(WeightFormat::Int8, &[], |s| {
        int8(s).replace("#define Q3W_PACKED 0", "#define Q3W_PACKED 1")
    });
    for run in [&run as &dyn Fn(Kernel, [u32; 3], &[Vec<u8>]) -> Vec<Vec<u8>>, &packed] {
        for shape in ATTENTION_INT8_SHAPES {
            attention_case_int8(&run, shape, 1, &mut rng);
        }
        for (kernel, shape) in ATTENTION_STEP_INT8_SHAPES {
            attention_step_case_int8(&run, kernel, shape, &mut rng);
        }
    }
}

/// The kernels take their simdgroup width and count from the builtins, so
/// they hold on GPUs whose simdgroups are not 32 wide (Intel and AMD GPUs in
/// Macs): the reducing kernels, built for 8- and 64-lane simdgroups.
#[test]
fn msl_kernels_hold_at_other_simdgroup_widths() {
    for width in [8, 64] {
        let def = format!("MSL_SHIM_SIMD_WIDTH={width}");
        let defines = [def.as_str()];
        let run = msl_run(&defines);
        let rows_per_wg = msl::MSL_MATVEC_LAYOUT.rows_per_wg();
        let run4 = msl_run_in(WeightFormat::Int4, &defines);
        for kernel in [Kernel::Int8MatvecNorm, Kernel::Int8MatvecNormSwiglu, Kernel::Int8MatvecAccumulate] {
            for (rows, cols, tokens) in [(66, 1000, 1), (130, 704, 2)] {
                let res = matvec_case(&run, kernel, rows_per_wg, 1, rows, cols, tokens, 3);
                assert_matvec(&format!("MSL {kernel:?} {rows}x{cols} width {width}"), &res);
                let f = WeightFormat::Int4;
                let res = matvec_case_in(&run4, kernel, f, false, rows_per_wg, 1, rows, cols, tokens, 4);
                assert_matvec(&format!("MSL int4 {kernel:?} {rows}x{cols} width {width}"), &res);
            }
        }
        let mut rng = StdRng::seed_from_u64(10);
        argmax_case(&run, 5555, 1000, true, &mut rng);
        attention_case(&run, (4, 2, 128, 600, 255, 3), &mut rng);
        attention_step_case(&run, Kernel::AttentionStepDirect, (4, 2, 128, 300, 200), &mut rng);
        attention_step_case(&run, Kernel::AttentionStep, (4, 2, 128, 600, 300), &mut rng);
        qk_norm_rope_case(&run, (4, 2, 128, 40, 36, 2), &mut rng);
        // Over an int8 KV cache (its scales' exchanges).
        let int8 = msl_run_edited(WeightFormat::Int8, &defines, |s| {
            s.replace("#define Q3W_KV_INT8 0", "#define Q3W_KV_INT8 1")
        });
        attention_step_case_int8(&int8, Kernel::AttentionStep, (4, 2, 128, 600, 300), &mut rng);
        qk_norm_rope_case_int8(&int8, (4, 2, 128, 40, 36, 2), &mut rng);
    }
}

/// The prompt-batch product's twin on SIMD-group matrices, in every
/// epilogue, against the CPU reference: rows not a multiple of the 64-row
/// tile or of an 8x8 block (13, 70; SwiGLU one more, as its rows come in
/// pairs), token counts not a multiple of the tile (5 and 37, and a tile
/// plus 5: two tiles whose spare tokens are NaN), K of 200 (a padded
/// tail) and 1,024 (32 chunks), NaN-poisoned outputs, and the accumulating
/// variant from a non-zero y. The twin rounds its weights to half: the
/// scales here keep every weight exact in half, so the comparison stays at
/// f32 tolerance (what rounding costs is the self-check's and the MLX
/// comparisons' to bound, and a weight rounded twice or not at all is
/// caught below).
#[test]
fn msl_int8_matmul_matches_cpu() {
    let run = msl_matmul_run(&[]);
    let mut seed = 300;
    for kernel in Kernel::ALL.into_iter().filter(|k| k.matvec_variant().is_some()) {
        let v = kernel.matvec_variant().unwrap();
        let tile = kernel.matmul_tokens_per_wg() as usize;
        let pair = |rows: usize| if v.swiglu { rows + rows % 2 } else { rows };
        for (rows, cols, tokens) in [(13, 200, 5), (13, 200, 37), (70, 200, tile + 5), (130, 1024, tile)] {
            seed += 1;
            let rows = pair(rows);
            let res = matmul_case_half_exact(&run, kernel, tile, rows, cols, tokens, seed);
            assert_eq!(res.len(), tokens);
            assert_matvec(&format!("MSL int8_matmul {kernel:?} {rows}x{cols} x{tokens}"), &res);
        }
    }
}

/// The twin's weights are rounded to half once: over ordinary int8 weights
/// (scales of full f32 precision) its products stay within half's rounding
/// of the weights (2^-11 relative, summed: 1e-3 of each output's scale,
/// the self-check's tolerance) but are not the f32 products' bits.
#[test]
fn msl_int8_matmul_rounds_weights_to_half_once() {
    let run = msl_matmul_run(&[]);
    let kernel = Kernel::Int8MatvecNorm;
    let tile = kernel.matmul_tokens_per_wg() as usize;
    let res = matmul_case(&run, kernel, tile, 70, 1024, tile + 5, 41);
    for (z, (got, want, scale)) in res.iter().enumerate() {
        assert_close(&format!("MSL int8_matmul half weights token {z}"), got, want, scale, 1e-3);
    }
    let f32_exact = std::panic::catch_unwind(|| assert_matvec("f32 tolerance", &res));
    assert!(f32_exact.is_err(), "the products match the f32 weights' at f32 tolerance: not rounded to half");
}

/// The prompt-batch product's twin over int4 weights, in every epilogue,
/// at the int8 case's shapes (rows not a multiple of the tile or of an 8x8
/// block, token counts not a multiple of the tile, two tiles whose spare
/// tokens are NaN, K of 200 and 1,024), outputs NaN-poisoned.
#[test]
fn msl_int4_matmul_matches_cpu() {
    let run = msl_matmul_run_edited(WeightFormat::Int4, &[], |s| s.to_string());
    let mut seed = 700;
    for kernel in Kernel::ALL.into_iter().filter(|k| k.matvec_variant().is_some()) {
        let v = kernel.matvec_variant().unwrap();
        let tile = kernel.matmul_tokens_per_wg() as usize;
        let pair = |rows: usize| if v.swiglu { rows + rows % 2 } else { rows };
        for (rows, cols, tokens) in [(13, 200, 5), (13, 200, 37), (70, 200, tile + 5), (130, 1024, tile)] {
            seed += 1;
            let rows = pair(rows);
            let rpw = kernels::MATMUL_ROWS_PER_WG;
            let res = matmul_case_for(&run, kernel, WeightFormat::Int4, rpw, tile, rows, cols, tokens, seed);
            assert_eq!(res.len(), tokens);
            assert_matvec(&format!("MSL int4 int8_matmul {kernel:?} {rows}x{cols} x{tokens}"), &res);
        }
    }
}

// ---------------------------------------------------------------------------
// The shim's SIMD-group matrices, against plain matrix products.

/// The probe's inputs (each simdgroup's A, B, C) and outputs, or why the
/// harness failed.
type ProbeRun = (Vec<[Mat; 3]>, Result<Vec<Vec<u8>>, String>);

/// Runs [`MATRIX_PROBE`] (its source edited by `edit`) built with
/// `defines`; returns each simdgroup's A, B and C, and the d and owned
/// buffers or why the harness failed.
fn run_probe(edit: impl Fn(&str) -> String, defines: &[&str], timeout_s: Option<u32>) -> ProbeRun {
    let src = format!("{}{}", msl::MSL_HEADER, edit(MATRIX_PROBE));
    let bin = build_entry("matrix_probe", &src, defines);
    let (mats, buffers) = matrix_probe_inputs(17);
    let launch =
        Launch { bindings: &MATRIX_PROBE_BINDINGS, threadgroup: MATRIX_PROBE_THREADGROUP, timeout_s };
    (mats, try_launch(&bin, &launch, [1, 1, 1], &buffers))
}

/// The shim's SIMD-group matrices compute plain matrix products: loads with
/// a stride and transposed, from device and threadgroup memory; stores with
/// a stride and transposed, writing nothing else; each lane holds the two
/// elements of the documented table (the header of metal_shim.h), in loads
/// and in stores; the diagonal constructor; two simdgroups at once, each on
/// its own matrices.
#[test]
fn shim_simdgroup_matrices_compute_plain_products() {
    // The table itself: every element of the 8x8 matrix has one owner.
    let mut seen = std::collections::BTreeSet::new();
    for l in 0..32 {
        for e in 0..2 {
            assert!(
                seen.insert(simdgroup_matrix_owner(l, e)),
                "two owners of {:?}",
                simdgroup_matrix_owner(l, e)
            );
        }
    }
    assert_eq!(seen.len(), 64);
    let (mats, out) = run_probe(|s| s.to_string(), &[], None);
    check_matrix_probe(&mats, &out.unwrap_or_else(|e| panic!("{e}"))).unwrap_or_else(|e| panic!("{e}"));
}

/// The probe's comparison catches a shim whose multiply takes two lanes'
/// elements in each other's place.
#[test]
fn shim_with_swapped_matrix_lanes_fails_the_plain_product() {
    let (mats, out) = run_probe(|s| s.to_string(), &["MSL_SHIM_MATRIX_SWAPS_LANES"], None);
    let out = out.unwrap_or_else(|e| panic!("{e}"));
    let err = check_matrix_probe(&mats, &out).expect_err("a broken multiply passed");
    assert!(err.contains(": D (0, "), "{err}");
}

/// A simdgroup-matrix multiply is collective: a lane that skips it while
/// its peers take part hangs the simdgroup, which the harness's alarm
/// turns into a failure (on the device it is undefined behaviour).
#[test]
fn a_lane_skipping_a_matrix_multiply_fails() {
    let skip = |s: &str| {
        let edited = s.replace(
            "simdgroup_multiply_accumulate(md, ma, mb, mc);",
            "if (lane != 3) { simdgroup_multiply_accumulate(md, ma, mb, mc); }",
        );
        assert_ne!(edited, s, "the substitution applies");
        edited
    };
    let (_, out) = run_probe(skip, &[], Some(5));
    let err = out.expect_err("a lane skipped a collective multiply unnoticed");
    assert!(err.contains("SIGALRM") || err.contains("signal: 14"), "failed, but not by the alarm: {err}");
}

/// The twin's epilogue relies on each lane's coordinates in the table: a
/// twin that takes its lanes' rows from another formula fails the same
/// comparison the real one passes.
#[test]
fn matmul_with_wrong_lane_coordinates_fails() {
    let kernel = Kernel::Int8MatvecNorm;
    let src = matmul_msl_source(kernel);
    let broken =
        src.replace("const uint fn = (quad & 2) * 2 + (lane % 2) * 2;", "const uint fn = (lane % 4) * 2;");
    assert_ne!(src, broken, "the substitution applies");
    let bin = build_entry("int8_matmul", &broken, &[]);
    let run = |k: Kernel, grid: [u32; 3], buffers: &[Vec<u8>]| {
        let launch = Launch { bindings: k.bindings(), threadgroup: kernels::MATMUL_MSL_WG, timeout_s: None };
        try_launch(&bin, &launch, grid, buffers).unwrap_or_else(|e| panic!("{e}"))
    };
    let tile = kernel.matmul_tokens_per_wg() as usize;
    let caught = std::panic::catch_unwind(|| {
        let res = matmul_case(&run, kernel, tile, 13, 200, 5, 7);
        assert_matvec("broken matmul", &res);
    });
    assert!(caught.is_err(), "a matmul writing its elements at the wrong coordinates passed");
}

// ---------------------------------------------------------------------------
// Teeth: the comparisons catch a broken kernel.

/// The matvec built with a simd_shuffle_xor that drops one lane's values
/// (its xor tree then misses them) must fail the same comparison the real
/// one passes.
#[test]
fn matvec_with_a_lane_dropped_from_its_tree_fails() {
    let kernel = Kernel::Int8MatvecNorm;
    let run = msl_run(&["MSL_SHIM_SHUFFLE_XOR_DROPS_LANE=5"]);
    let res = matvec_case(&run, kernel, msl::MSL_MATVEC_LAYOUT.rows_per_wg(), 1, 66, 1024, 1, 99);
    let caught = std::panic::catch_unwind(|| assert_matvec("broken matvec", &res));
    assert!(caught.is_err(), "a matvec missing one lane's products passed");
}

/// Whether the comparison with the CPU reference of `kernel`'s int4 matvec
/// or (`tiled`) prompt product fails with its MSL source edited by `edit`
/// (which must change it).
fn int4_edit_fails(kernel: Kernel, tiled: bool, edit: fn(&str) -> String) -> bool {
    let source = if tiled {
        matmul_msl_source_in(kernel, WeightFormat::Int4)
    } else {
        msl::msl_source_in(kernel, WeightFormat::Int4).unwrap()
    };
    assert_ne!(edit(&source), source, "the substitution applies");
    std::panic::catch_unwind(|| {
        let res = if tiled {
            let run = msl_matmul_run_edited(WeightFormat::Int4, &[], edit);
            let (rpw, tile) = (kernels::MATMUL_ROWS_PER_WG, kernel.matmul_tokens_per_wg() as usize);
            matmul_case_for(&run, kernel, WeightFormat::Int4, rpw, tile, 13, 200, 5, 98)
        } else {
            let run = msl_run_edited(WeightFormat::Int4, &[], edit);
            let rpw = msl::MSL_MATVEC_LAYOUT.rows_per_wg();
            matvec_case_in(&run, kernel, WeightFormat::Int4, false, rpw, 1, 66, 1024, 2, 98)
        };
        assert_matvec("edited int4 product", &res);
    })
    .is_err_and(|e| {
        // The comparison's failure (`... got G, want W`), not another.
        let msg = e.downcast_ref::<String>().cloned().unwrap_or_default();
        msg.contains("want")
    })
}

/// The int4 twins with a word's nibbles taken in the wrong order, or a
/// step's scale from the wrong quant group, fail the comparison the real
/// ones pass.
#[test]
fn int4_twins_with_nibbles_or_scales_swapped_fail() {
    let kernel = Kernel::Int8MatvecAccumulate;
    // The matvec: values 0..3 and 4..7 of each step's first word trade
    // places; then int8's steps per group (step j reads group j / 4).
    let nibbles: fn(&str) -> String = |s| {
        s.replace(
            "dot(i4x4(wv.x), a0) + dot(i4x4(wv.x >> 4), a1)",
            "dot(i4x4(wv.x >> 4), a0) + dot(i4x4(wv.x), a1)",
        )
    };
    let scales: fn(&str) -> String =
        |s| s.replace("steps_per_group = Q3W_GROUP_WORDS / 8;", "steps_per_group = Q3W_GROUP_WORDS / 4;");
    assert!(int4_edit_fails(kernel, false, nibbles), "a matvec with its nibbles swapped passed");
    assert!(int4_edit_fails(kernel, false, scales), "a matvec reading the wrong scales passed");
    // The prompt product: each word's high nibbles staged first.
    let tiled_nibbles: fn(&str) -> String =
        |s| s.replace("i4x4(wv[b / 2] >> (4 * (b % 2)))", "i4x4(wv[b / 2] >> (4 * (1 - b % 2)))");
    assert!(int4_edit_fails(kernel, true, tiled_nibbles), "a prompt product with its nibbles swapped passed");
}

/// argmax_partial without its simdgroup maximum (each lane keeps its own)
/// must give wrong chunk winners.
#[test]
fn argmax_without_simd_max_fails() {
    let k = Kernel::ArgmaxPartial;
    let src = msl::msl_source(k).unwrap();
    let broken = src.replace("simd_max(best_v)", "best_v");
    assert_ne!(src, broken, "the substitution applies");
    let bin = build(k, &broken, &[]);
    let mut rng = StdRng::seed_from_u64(9);
    let n = 4096;
    let v = nonzero(&mut rng, n);
    let params = argmax_partial_params(n as u32, 1024);
    let out = run(&bin, k, kernels::grid(4), &[params, f32s(&v), poisoned(4), poisoned(4)]);
    let idx = to_u32(&out[1]);
    let right = (0..4).filter(|c| idx[*c] as usize == c * 1024 + argmax_ref(&v[c * 1024..(c + 1) * 1024]));
    assert!(right.count() < 4, "a broken argmax passed");
}

/// A write one element past the end of a buffer (Metal would corrupt
/// memory quietly) crashes the harness: buffers end at a guard page.
#[test]
fn out_of_bounds_write_fails() {
    let k = Kernel::AttentionReduce;
    let src = msl::msl_source(k).unwrap();
    let broken = src.replace("out[at + 3] = res.w;", "out[at + 4] = res.w;");
    assert_ne!(src, broken, "the substitution applies");
    let bin = build(k, &broken, &[]);
    let (nh, hd) = (2usize, 64usize);
    let res = try_run(
        &bin,
        k,
        kernels::grid(nh as u32),
        &[
            reduce_params(hd, 1, nh * hd),
            f32s(&[0.0, 1.0].repeat(nh)),
            f32s(&vec![1.0; nh * hd]),
            poisoned(nh * hd),
        ],
    );
    let err = res.expect_err("an out-of-bounds write went unnoticed");
    assert!(err.contains("SIGSEGV"), "failed, but not at the guard page: {err}");
}

// ---------------------------------------------------------------------------
// Vector stores.

/// The left-hand side of each assignment in `src` (comments stripped): the
/// text before a `=`, `+=`, `-=`, `*=` or `/=` that is not a comparison, on
/// its line.
fn assignment_targets(src: &str) -> Vec<String> {
    let mut out = Vec::new();
    for line in strip_comments(src).lines() {
        let b = line.as_bytes();
        for (i, _) in line.match_indices('=') {
            let prev = if i > 0 { b[i - 1] } else { b' ' };
            let next = b.get(i + 1).copied().unwrap_or(b' ');
            if next == b'=' || matches!(prev, b'=' | b'<' | b'>' | b'!') {
                continue; // ==, <=, >=, !=
            }
            let lhs = line[..i].trim_end().trim_end_matches(['+', '-', '*', '/']).trim_end();
            // The statement's target: from the last `;`, `{` or `(`-free start.
            let start = lhs.rfind([';', '{']).map_or(0, |s| s + 1);
            out.push(lhs[start..].trim().to_string());
        }
    }
    out
}

/// Whether an assignment target stores one component of a vector that is
/// an array element (`a[i][c]`, `a[i].x`): in workgroup or device memory,
/// lanes storing different components of one vector race, because a
/// compiler may store the whole vector back.
fn stores_a_component(target: &str) -> bool {
    let t = target.trim_end();
    if let Some(rest) = t.strip_suffix(['x', 'y', 'z', 'w']) {
        return rest.trim_end().strip_suffix('.').is_some_and(|r| r.trim_end().ends_with(']'));
    }
    // `...][...]` at the end: two index groups in a row.
    let Some(inner) = t.strip_suffix(']') else { return false };
    let mut depth = 0;
    for (i, c) in inner.char_indices().rev() {
        match c {
            ']' => depth += 1,
            '[' if depth > 0 => depth -= 1,
            '[' => return inner[..i].trim_end().ends_with(']'),
            _ => {}
        }
    }
    false
}

/// No kernel (WGSL or MSL) stores a single component of a vector array
/// element: lanes writing different components of one vector in workgroup
/// or device memory (`q_s[d / 4][d % 4] = ...`) may be compiled to
/// read-modify-writes of the whole vector that lose each other's
/// components, which neither lavapipe nor the shim would show. Such stores
/// go through scalar arrays, or one lane writes the whole vector.
#[test]
fn no_kernel_stores_one_component_of_a_vector_element() {
    // The check's own teeth.
    let caught = |s: &str| assignment_targets(s).iter().any(|t| stores_a_component(t));
    for hazard in [
        "q_s[d / 4][d % 4] = rope_at(a, b);",
        "    k_cache[row + w / 4u][w % 4u] = pack2x16float(lo);",
        "x_t[o][lane] = v.x;",
        "if (c) { red_f[lane.sg_id].x = s; }",
        "acc[i][j] += v;",
    ] {
        assert!(caught(hazard), "missed: {hazard}");
    }
    for fine in [
        "q_s[i] = vec4<f32>(a, b, c, d);",
        "sq.x += a * a;",
        "if a[i][j] == b[k] { t = a[i][j]; }",
        "let v = w[r * k + q / 4u][q % 4u];",
        "for (var i = 0u; i <= n[k][0]; i++) {",
        "total += acc_s[2 * r][r % 4];",
    ] {
        assert!(!caught(fine), "flagged: {fine}");
    }

    let mut files = Vec::new();
    for dir in ["kernels/msl", "kernels/wgsl"] {
        for entry in std::fs::read_dir(root().join(dir)).unwrap() {
            files.push(entry.unwrap().path());
        }
    }
    // 13 WGSL files (step.wgsl is generated now) and 6 MSL twins.
    assert!(files.len() >= 19, "kernel sources found: {}", files.len());
    for path in files {
        let src = std::fs::read_to_string(&path).unwrap();
        for t in assignment_targets(&src) {
            assert!(!stores_a_component(&t), "{}: stores one component of a vector: `{t}`", path.display());
        }
    }
}
