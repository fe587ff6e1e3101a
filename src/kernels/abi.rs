//! The host-kernel ABI: every struct the host writes and a kernel reads
//! (each kernel's launch parameters, the GPU-resident decode [`Step`]) and
//! the limits and sentinels both sides use, defined once, in Rust. The WGSL
//! and MSL declarations are generated from these definitions into each
//! kernel's source ([`wgsl_decls`], [`msl_decls`]): no kernel file declares
//! them by hand. Every field is a 4-byte scalar, so field `i` lies at byte
//! `4 i` in `#[repr(C)]` Rust, in WGSL's uniform and storage layouts and in
//! MSL alike (tests check the generated WGSL's offsets with naga).

use crate::converted::QUANT_GROUP;

/// The scalar type of a field of a shared struct.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scalar {
    U32,
    F32,
}

impl Scalar {
    fn wgsl(self) -> &'static str {
        match self {
            Scalar::U32 => "u32",
            Scalar::F32 => "f32",
        }
    }

    fn msl(self) -> &'static str {
        match self {
            Scalar::U32 => "uint",
            Scalar::F32 => "float",
        }
    }
}

/// A Rust type a shared struct's field may have.
pub trait ScalarField {
    const SCALAR: Scalar;
}
impl ScalarField for u32 {
    const SCALAR: Scalar = Scalar::U32;
}
impl ScalarField for f32 {
    const SCALAR: Scalar = Scalar::F32;
}

/// One field of a shared struct.
#[derive(Debug, Clone, Copy)]
pub struct Field {
    pub name: &'static str,
    pub scalar: Scalar,
    /// Byte offset in the Rust struct.
    pub offset: usize,
    /// The field's rustdoc, repeated as a comment in the kernels' source.
    pub doc: &'static str,
}

/// A struct shared by host and kernels, as the generators see it.
#[derive(Debug, Clone, Copy)]
pub struct StructDef {
    /// Its name in the kernels (`Params` for every kernel's parameters).
    pub name: &'static str,
    pub fields: &'static [Field],
    /// `size_of` the Rust struct.
    pub size: usize,
}

/// A `#[repr(C)]` struct the host writes and kernels read.
pub trait GpuStruct: bytemuck::Pod {
    const DEF: StructDef;
}

/// Defines a `#[repr(C)]` struct of 4-byte scalars shared with the kernels
/// under the name given first, and its [`GpuStruct`] description.
macro_rules! gpu_struct {
    (
        $(#[doc = $doc:literal])*
        $kernel_name:literal pub struct $name:ident {
            $($(#[doc = $fdoc:literal])* pub $field:ident: $ty:ty,)*
        }
    ) => {
        $(#[doc = $doc])*
        #[repr(C)]
        #[derive(Debug, Clone, Copy, PartialEq, Default, bytemuck::Pod, bytemuck::Zeroable)]
        pub struct $name {
            $($(#[doc = $fdoc])* pub $field: $ty,)*
        }
        impl $crate::kernels::abi::GpuStruct for $name {
            const DEF: $crate::kernels::abi::StructDef = $crate::kernels::abi::StructDef {
                name: $kernel_name,
                fields: &[$($crate::kernels::abi::Field {
                    name: stringify!($field),
                    scalar: <$ty as $crate::kernels::abi::ScalarField>::SCALAR,
                    offset: std::mem::offset_of!($name, $field),
                    doc: concat!($($fdoc),*),
                }),*],
                size: std::mem::size_of::<$name>(),
            };
        }
    };
}
pub(crate) use gpu_struct;

gpu_struct! {
    /// The decode state kept on the GPU (the session's `step` buffer,
    /// written by the host before a prompt or after dropping queued steps):
    /// `argmax_final` advances `pos`, so decode steps queue up without the
    /// host in the loop. Batched (prefill) launches read token z's position
    /// as `pos + z`.
    "Step" pub struct Step {
        /// Position of the token being processed.
        pub pos: u32,
        /// First position argmax_final may write a token to.
        pub fill_end: u32,
    }
}

/// Largest head_dim the attention kernels hold in workgroup memory.
pub const MAX_HEAD_DIM: usize = 256;

/// `n` rounded up to the quant group: the length the kernels read a matrix
/// row or an activation row in (whole groups: `k_words` is
/// `quant_padded(cols) / 4`, and a matvec reads its input in whole groups).
pub const fn quant_padded(n: usize) -> usize {
    n.div_ceil(QUANT_GROUP) * QUANT_GROUP
}

/// Longest sampling-penalty window, in tokens (`sample_penalty` holds the
/// window in workgroup memory and compares each token with the others).
pub const MAX_PENALTY_WINDOW: u32 = 1024;

/// The largest top-k the sampler's two-launch path takes (its merge holds
/// the top entries in workgroup memory, one per invocation).
pub const SAMPLE_TOP_K_MAX: u32 = 128;

/// The index sentinel of the argmax kernels: no candidate yet.
pub const NONE: u32 = u32::MAX;

/// Invocations per K row in `attention_partial`'s scores: consecutive
/// lanes read one row's consecutive 16-byte quads (coalesced loads; one
/// lane per row made every load of a 32-wide subgroup touch 32 cache lines:
/// 6.8 against 6.3 µs a launch on an H200, BENCHMARKS.md 2026-12-02).
pub const ATTENTION_KEY_LANES: u32 = 8;

/// The constants generated into the kernels: (name, value, why).
const CONSTANTS: [(&str, u32, &str); 5] = [
    ("MAX_HEAD_DIM", MAX_HEAD_DIM as u32, "largest head_dim (workgroup arrays)"),
    ("NONE", NONE, "argmax: no candidate yet"),
    ("MAX_PENALTY_WINDOW", MAX_PENALTY_WINDOW, "sampling: longest penalty window"),
    ("SAMPLE_TOP_K_MAX", SAMPLE_TOP_K_MAX, "sampling: largest top-k of the two-launch path"),
    ("ATTENTION_KEY_LANES", ATTENTION_KEY_LANES, "attention: invocations per K row in the scores"),
];

/// Whether `word` occurs in `text` as a whole identifier outside `//`
/// comments (the kernels use no others).
fn uses(text: &str, word: &str) -> bool {
    let ident = |c: char| c.is_ascii_alphanumeric() || c == '_';
    text.lines().map(|l| l.split("//").next().unwrap_or_default()).any(|code| {
        code.match_indices(word).any(|(i, _)| {
            !code[..i].chars().next_back().is_some_and(ident)
                && !code[i + word.len()..].chars().next().is_some_and(ident)
        })
    })
}

/// A field's rustdoc as one comment line.
fn comment(doc: &str) -> String {
    let words: Vec<&str> = doc.split_whitespace().collect();
    if words.is_empty() {
        String::new()
    } else {
        format!(" // {}", words.join(" "))
    }
}

/// What [`wgsl_decls`] and [`msl_decls`] generate for a kernel: its
/// `params` struct, plus [`Step`] and each shared constant that `text` (the
/// kernel's own source) names.
fn needed<'a>(
    params: &'a StructDef,
    text: &str,
) -> (Vec<&'a StructDef>, Vec<(&'static str, u32, &'static str)>) {
    let mut structs = vec![params];
    if uses(text, Step::DEF.name) && params.name != Step::DEF.name {
        structs.insert(0, &Step::DEF);
    }
    let consts = CONSTANTS.into_iter().filter(|(name, _, _)| uses(text, name)).collect();
    (structs, consts)
}

/// The WGSL declarations of `params` (as `Params`), and of [`Step`] and the
/// shared constants where `text` uses them.
pub fn wgsl_decls(params: &StructDef, text: &str) -> String {
    let (structs, consts) = needed(params, text);
    let mut out =
        String::from("// Generated from the Rust definitions (src/kernels/abi.rs and the families).\n");
    for (name, value, why) in consts {
        out += &format!("const {name}: u32 = {value}u; // {why}\n");
    }
    for s in structs {
        out += &format!("struct {} {{\n", s.name);
        for f in s.fields {
            out += &format!("    {}: {},{}\n", f.name, f.scalar.wgsl(), comment(f.doc));
        }
        out += "}\n";
    }
    out
}

/// The MSL declarations of `params` (as `Params`), and of [`Step`] and the
/// shared constants where `text` uses them.
pub fn msl_decls(params: &StructDef, text: &str) -> String {
    let (structs, consts) = needed(params, text);
    let mut out =
        String::from("// Generated from the Rust definitions (src/kernels/abi.rs and the families).\n");
    for (name, value, why) in consts {
        out += &format!("constant constexpr uint {name} = {value}u; // {why}\n");
    }
    for s in structs {
        out += &format!("struct {} {{\n", s.name);
        for f in s.fields {
            out += &format!("    {} {};{}\n", f.scalar.msl(), f.name, comment(f.doc));
        }
        out += "};\n";
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::Kernel;

    /// Every shared struct is packed 4-byte scalars: field i at byte 4 i.
    #[test]
    fn every_shared_struct_is_packed_scalars() {
        let defs = Kernel::ALL.iter().map(|k| k.row().params).chain([&Step::DEF]);
        for d in defs {
            assert_eq!(d.size, 4 * d.fields.len(), "{}", d.name);
            for (i, f) in d.fields.iter().enumerate() {
                assert_eq!(f.offset, 4 * i, "{}.{}", d.name, f.name);
            }
        }
    }

    /// naga lays out each generated WGSL struct as the Rust one: same
    /// member names, offsets, scalar types and size.
    #[test]
    fn generated_wgsl_structs_have_the_rust_layout() {
        for k in Kernel::ALL {
            let module = naga::front::wgsl::parse_str(&k.source(false)).expect("parses");
            let mut seen = 0;
            for d in [k.row().params, &Step::DEF] {
                let Some((_, ty)) = module.types.iter().find(|(_, t)| t.name.as_deref() == Some(d.name))
                else {
                    continue;
                };
                let naga::TypeInner::Struct { members, span } = &ty.inner else {
                    panic!("{} not a struct", d.name)
                };
                assert_eq!(*span as usize, d.size, "{k:?}: {}", d.name);
                let got: Vec<(String, u32, naga::Scalar)> = members
                    .iter()
                    .map(|m| {
                        let naga::TypeInner::Scalar(s) = module.types[m.ty].inner else {
                            panic!("not a scalar")
                        };
                        (m.name.clone().unwrap(), m.offset, s)
                    })
                    .collect();
                let want: Vec<(String, u32, naga::Scalar)> = d
                    .fields
                    .iter()
                    .map(|f| {
                        let s = match f.scalar {
                            Scalar::U32 => naga::Scalar::U32,
                            Scalar::F32 => naga::Scalar::F32,
                        };
                        (f.name.to_string(), f.offset as u32, s)
                    })
                    .collect();
                assert_eq!(got, want, "{k:?}: {}", d.name);
                seen += 1;
            }
            assert!(seen >= 1, "{k:?}: no Params in its source");
        }
    }

    /// The generated declarations are the only ones: no kernel file (WGSL,
    /// MSL, or what a family shares) declares a shared struct or constant
    /// itself, and every full source declares `Params` exactly once.
    #[test]
    fn no_kernel_file_declares_the_abi_by_hand() {
        let shared = [
            crate::kernels::matvec::INT8_COMMON,
            crate::kernels::attention::ATTENTION_COMMON,
            include_str!("../../kernels/wgsl/int8_matmul.wgsl"),
            crate::kernels::matmul::MATMUL_MSL,
            include_str!("../../kernels/wgsl/attention_prefill.wgsl"),
            crate::kernels::matmul::MATMUL_COOP_WGSL,
            crate::kernels::matmul::F16_STAGE_WGSL,
            crate::kernels::matmul::MATMUL_COOP_EMULATED_WGSL,
            crate::kernels::matmul::MATMUL_COOP_TILE_WGSL,
        ];
        let files = Kernel::ALL.iter().flat_map(|k| [Some(k.wgsl()), k.row().msl]).flatten().chain(shared);
        for text in files {
            let head = text.lines().next().unwrap_or_default();
            for name in ["Params", "Step"] {
                assert!(!uses(text, &format!("struct {name}")), "`{head}`: declares {name}");
            }
            for (name, _, _) in CONSTANTS {
                for decl in [format!("const {name}"), format!("uint {name}")] {
                    assert!(!uses(text, &decl), "`{head}`: declares {name}");
                }
            }
        }
        let once = |src: &str| src.matches("struct Params {").count() == 1;
        for k in Kernel::ALL {
            assert!(once(&k.source(true)) && once(&k.source(false)), "{k:?}");
            assert!(crate::kernels::msl::msl_source(k).is_none_or(|src| once(&src)), "{k:?}");
            assert!(k.matmul_source().is_none_or(|(src, _)| once(&src)), "{k:?}");
            assert!(k.matmul_constants().is_none_or(|c| once(&c.msl_source())), "{k:?}");
        }
        assert!(once(&crate::kernels::attention_prefill_source(true).0));
        assert!(once(&crate::kernels::matmul::stage_source()));
        for k in Kernel::ALL.into_iter().filter(|k| k.prefill_tiled()) {
            let coop = crate::kernels::MatmulConstants { coop: true, ..k.matmul_constants().unwrap() };
            assert!(once(&coop.source()), "{k:?}");
            assert!(once(&crate::kernels::MatmulConstants { emulated: true, ..coop }.source()), "{k:?}");
        }
    }

    #[test]
    fn only_the_names_a_kernel_uses_are_declared() {
        let d = Step::DEF;
        let src = wgsl_decls(&d, "fn f() { let a = NONE; }");
        assert!(src.contains("const NONE: u32 = 4294967295u;") && !src.contains("MAX_HEAD_DIM"));
        let src = msl_decls(&d, "threadgroup float head[MAX_HEAD_DIM]; // NONE, NONE_OF_THESE");
        assert!(src.contains("constant constexpr uint MAX_HEAD_DIM = 256u;") && !src.contains("NONE ="));
        assert!(src.contains("struct Step {\n    uint pos; // Position of the token being processed.\n"));
    }
}
