//! A WGSL kernel specialised before it reaches the driver: its override
//! constants substituted (naga's own override processing) and every `if`
//! whose condition is then a constant left with only the branch it takes.
//!
//! Why: a kernel family is one program whose variants (int4 or int8, fused
//! norm, batched rows, the prompt batch, ...) are override constants. A
//! driver sees the constants only as values, and Mesa's compilers inline
//! every call, those in branches no variant of this pipeline can take
//! included, before they drop dead code: lavapipe spent 0.6-0.8 s building
//! each `int8_matvec` pipeline, 0.04 s once its dead branches were gone
//! first. What runs is unchanged: a constant condition picks the same
//! branch here as in the driver.

use std::collections::HashMap;

use naga::{BinaryOperator, Block, Expression, Handle, Literal, Module, Statement, UnaryOperator};

/// `source`'s module for `entry` with `constants` substituted and its
/// constant branches resolved, validated; `None` when any step fails (the
/// caller then hands the driver the WGSL and constants unchanged, whose
/// own errors name the problem).
pub fn specialise(source: &str, entry: &str, constants: &[(&str, f64)]) -> Option<Module> {
    specialise_module(&naga::front::wgsl::parse_str(source).ok()?, entry, constants)
}

/// [`specialise`] of a program already parsed. A panic in naga on the way
/// (its compaction has had corner cases) is a `None` too.
pub(crate) fn specialise_module(module: &Module, entry: &str, constants: &[(&str, f64)]) -> Option<Module> {
    std::panic::catch_unwind(|| specialised(module, entry, constants)).ok().flatten()
}

fn specialised(module: &Module, entry: &str, constants: &[(&str, f64)]) -> Option<Module> {
    let info = validator().validate(module).ok()?;
    let mut values = naga::back::PipelineConstants::default();
    for &(name, value) in constants {
        values.insert(name.to_string(), value);
    }
    let (module, _) = naga::back::pipeline_constants::process_overrides(
        module,
        &info,
        Some((naga::ShaderStage::Compute, entry)),
        &values,
    )
    .ok()?;
    let mut module = module.into_owned();
    let Module { constants, global_expressions, functions, entry_points, .. } = &mut module;
    let globals = Globals { constants, expressions: global_expressions };
    let bodies =
        functions.iter_mut().map(|(_, f)| f).chain(entry_points.iter_mut().map(|ep| &mut ep.function));
    for function in bodies {
        let mut pruner = Pruner {
            expressions: &function.expressions,
            globals: &globals,
            locals: HashMap::new(),
            loads: HashMap::new(),
        };
        pruner.prune(&mut function.body);
        // Names only label values for a backend's output; a name kept on a
        // value of a pruned branch would keep its call's callee alive, and
        // compaction then fails on the callee it drops.
        function.named_expressions.clear();
    }
    // Drops what the pruned branches alone used: the driver would still
    // translate (and inline into) functions nothing calls.
    naga::compact::compact(&mut module, naga::compact::KeepUnused::No);
    validator().validate(&module).ok()?;
    Some(module)
}

fn validator() -> naga::valid::Validator {
    naga::valid::Validator::new(naga::valid::ValidationFlags::all(), naga::valid::Capabilities::all())
}

/// The module's constants, through which a function's expression may name
/// a value.
struct Globals<'a> {
    constants: &'a naga::Arena<naga::Constant>,
    expressions: &'a naga::Arena<Expression>,
}

/// What one function's walk knows: its expressions, the module's
/// constants, the constant values its local variables hold at the current
/// statement, and those its loads of them took where they were evaluated.
struct Pruner<'a> {
    expressions: &'a naga::Arena<Expression>,
    globals: &'a Globals<'a>,
    locals: HashMap<Handle<naga::LocalVariable>, bool>,
    loads: HashMap<Handle<Expression>, bool>,
}

impl Pruner<'_> {
    /// Empties the branch an `if` with a constant condition never takes,
    /// in `block` and every block inside it. WGSL's `a && b` reaches naga
    /// as a local variable set in an `if` on `a`: a variable's constant
    /// value is followed along straight-line code (an `if` whose branch is
    /// decided runs it unconditionally, and past an undecided one it keeps
    /// a value both branches leave), and forgotten past a loop or a call
    /// that could write it.
    fn prune(&mut self, block: &mut Block) {
        for statement in block.iter_mut() {
            match statement {
                Statement::Emit(range) => {
                    for expr in range.clone() {
                        if let Expression::Load { pointer } = self.expressions[expr] {
                            if let Some(&b) = self.local(pointer).and_then(|v| self.locals.get(&v)) {
                                self.loads.insert(expr, b);
                            }
                        }
                    }
                }
                Statement::Store { pointer, value } => {
                    if let Some(v) = self.local(*pointer) {
                        match self.constant_bool(*value) {
                            Some(b) => self.locals.insert(v, b),
                            None => self.locals.remove(&v),
                        };
                    }
                }
                Statement::If { condition, accept, reject } => match self.constant_bool(*condition) {
                    Some(true) => {
                        *reject = Block::new();
                        self.prune(accept);
                    }
                    Some(false) => {
                        *accept = Block::new();
                        self.prune(reject);
                    }
                    None => {
                        // Either branch may run: what both leave alike holds after.
                        let before = self.locals.clone();
                        self.prune(accept);
                        let after_accept = std::mem::replace(&mut self.locals, before);
                        self.prune(reject);
                        self.locals.retain(|v, b| after_accept.get(v) == Some(b));
                    }
                },
                Statement::Block(inner) => self.prune(inner),
                Statement::Loop { body, continuing, .. } => {
                    self.locals.clear();
                    self.prune_apart(body);
                    self.prune_apart(continuing);
                }
                Statement::Switch { cases, .. } => {
                    for case in cases.iter_mut() {
                        self.prune_apart(&mut case.body);
                    }
                }
                Statement::Call { arguments, .. } if arguments.iter().any(|&a| self.points_into_local(a)) => {
                    self.locals.clear();
                }
                _ => {}
            }
        }
    }

    /// [`Self::prune`] of a block that may or may not run (or run again):
    /// nothing known in it is known after it.
    fn prune_apart(&mut self, block: &mut Block) {
        self.prune(block);
        self.locals.clear();
    }

    /// Whether `expr` is a pointer into a local variable (the variable or
    /// a part of it).
    fn points_into_local(&self, expr: Handle<Expression>) -> bool {
        match self.expressions[expr] {
            Expression::LocalVariable(_) => true,
            Expression::Access { base, .. } | Expression::AccessIndex { base, .. } => {
                self.points_into_local(base)
            }
            _ => false,
        }
    }

    /// The local variable `pointer` points at, when it is one.
    fn local(&self, pointer: Handle<Expression>) -> Option<Handle<naga::LocalVariable>> {
        match self.expressions[pointer] {
            Expression::LocalVariable(v) => Some(v),
            _ => None,
        }
    }

    /// The value of a boolean expression made of constants (`!`, `&&` and
    /// `||` over literals, named constants, loads of locals holding
    /// constants and comparisons of integer constants); `false && x` is
    /// false and `true || x` true whatever x is (naga's expressions have
    /// no side effects).
    fn constant_bool(&self, expr: Handle<Expression>) -> Option<bool> {
        let of = |e| self.constant_bool(e);
        match self.expressions[expr] {
            Expression::Literal(Literal::Bool(b)) => Some(b),
            Expression::Constant(c) => global_bool(self.globals.constants[c].init, self.globals),
            Expression::Load { .. } => self.loads.get(&expr).copied(),
            Expression::Unary { op: UnaryOperator::LogicalNot, expr } => of(expr).map(|b| !b),
            Expression::Binary { op: BinaryOperator::LogicalAnd, left, right } => match (of(left), of(right))
            {
                (Some(false), _) | (_, Some(false)) => Some(false),
                (Some(true), Some(true)) => Some(true),
                _ => None,
            },
            Expression::Binary { op: BinaryOperator::LogicalOr, left, right } => {
                match (of(left), of(right)) {
                    (Some(true), _) | (_, Some(true)) => Some(true),
                    (Some(false), Some(false)) => Some(false),
                    _ => None,
                }
            }
            Expression::Binary { op, left, right } => {
                let a = constant_int(left, self.expressions, self.globals)?;
                let b = constant_int(right, self.expressions, self.globals)?;
                match op {
                    BinaryOperator::Equal => Some(a == b),
                    BinaryOperator::NotEqual => Some(a != b),
                    BinaryOperator::Less => Some(a < b),
                    BinaryOperator::LessEqual => Some(a <= b),
                    BinaryOperator::Greater => Some(a > b),
                    BinaryOperator::GreaterEqual => Some(a >= b),
                    _ => None,
                }
            }
            _ => None,
        }
    }
}

/// An integer literal's or named integer constant's value.
fn constant_int(
    expr: naga::Handle<Expression>,
    expressions: &naga::Arena<Expression>,
    globals: &Globals,
) -> Option<i64> {
    match expressions[expr] {
        Expression::Constant(c) => global_int(globals.constants[c].init, globals),
        Expression::Literal(l) => literal_int(l),
        _ => None,
    }
}

fn global_int(expr: Handle<Expression>, globals: &Globals) -> Option<i64> {
    match globals.expressions[expr] {
        Expression::Literal(l) => literal_int(l),
        Expression::Constant(c) => global_int(globals.constants[c].init, globals),
        _ => None,
    }
}

fn literal_int(literal: Literal) -> Option<i64> {
    match literal {
        Literal::U32(v) => Some(v.into()),
        Literal::I32(v) => Some(v.into()),
        Literal::AbstractInt(v) => Some(v),
        _ => None,
    }
}

/// A module-scope expression's boolean value, when it is one.
fn global_bool(expr: Handle<Expression>, globals: &Globals) -> Option<bool> {
    match globals.expressions[expr] {
        Expression::Literal(Literal::Bool(b)) => Some(b),
        Expression::Constant(c) => global_bool(globals.constants[c].init, globals),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::specialise;
    use crate::kernels::{Kernel, MatvecLayout};

    fn function_names(module: &naga::Module) -> Vec<String> {
        module.functions.iter().filter_map(|(_, f)| f.name.clone()).collect()
    }

    /// The matvec's int8 one-token pipeline keeps the code it runs and none
    /// of the int4, integer-dot, prompt-batch or batched-row paths, which
    /// the unspecialised program holds.
    #[test]
    fn an_int8_decode_matvec_keeps_only_its_own_paths() {
        let kernel = Kernel::Int8MatvecNorm;
        let source = kernel.source(true);
        let constants = kernel.split_constants(MatvecLayout::RowsPerTeam.default_split());
        let whole = naga::front::wgsl::parse_str(&source).unwrap();
        let dead = ["quantise_x", "step4_i4", "step8_i4", "matmul", "split_k_rows", "partial8"];
        for name in dead.iter().chain(&["decode_token", "partial4"]) {
            assert!(function_names(&whole).iter().any(|n| n == name), "{name} in the program");
        }
        let module = specialise(&source, kernel.entry(), &constants).expect("specialised");
        let names = function_names(&module);
        for name in dead {
            assert!(!names.iter().any(|n| n == name), "{name} left in {names:?}");
        }
        for name in ["decode_token", "partial4"] {
            assert!(names.iter().any(|n| n == name), "{name} dropped from {names:?}");
        }
        assert!(module.overrides.is_empty());
    }

    /// Every branch is kept or dropped by the value its condition has:
    /// `!`, `&&`, `||` and integer comparisons over overrides, a runtime
    /// operand deciding nothing unless the other one does.
    #[test]
    fn branches_follow_their_constant_conditions() {
        let source = "override A: bool; override N: u32;
            @group(0) @binding(0) var<storage, read_write> out: array<u32>;
            fn when_and() { out[0] = 1u; }
            fn unless_and() { out[0] = 2u; }
            fn when_or() { out[1] = 1u; }
            fn when_not() { out[2] = 1u; }
            fn when_mixed() { out[3] = 1u; }
            @compute @workgroup_size(1) fn main() {
                let runtime = out[4] > 0u;
                if A && N > 2u { when_and(); } else { unless_and(); }
                if A || N == 7u { when_or(); }
                if !A { when_not(); }
                if runtime && A { when_mixed(); }
            }";
        let kept = |a: bool, n: u32| {
            let module =
                specialise(source, "main", &[("A", f64::from(u8::from(a))), ("N", f64::from(n))]).unwrap();
            let mut names = function_names(&module);
            names.sort();
            names
        };
        assert_eq!(kept(true, 3), ["when_and", "when_mixed", "when_or"]);
        assert_eq!(kept(true, 2), ["unless_and", "when_mixed", "when_or"]);
        assert_eq!(kept(false, 7), ["unless_and", "when_not", "when_or"]);
        assert_eq!(kept(false, 3), ["unless_and", "when_not"]);
    }

    /// A program naga rejects, or constants it lacks, leave the WGSL to the
    /// driver's own path (and its named error).
    #[test]
    fn what_naga_cannot_specialise_is_left_alone() {
        assert!(specialise("fn broken( {", "main", &[]).is_none());
        let source = "@compute @workgroup_size(1) fn main() {}";
        assert!(specialise(source, "main", &[("MISSING", 1.0)]).is_none());
        assert!(specialise(source, "main", &[]).is_some());
    }
}
