//! Namespaces that cannot come to hold themselves: every value a template
//! stores in a namespace passes a guard.
//!
//! minijinja walks a namespace's contents recursively to print, hash or
//! compare it, so a namespace that holds itself (`{% set ns.me = ns %}`,
//! or `[ns]`, or a view of `ns`) recurses until the stack runs out and the
//! process aborts. A namespace is the only value a template can change
//! once it is made, so only a store into one (`{% set ns.attr = ... %}`,
//! `{% set ns.attr %}...{% endset %}`) can close such a cycle. minijinja
//! offers no hook on that store (it assigns to its own namespace type
//! only), so before compiling, the template's source is rewritten
//! ([`guard_namespace_stores`]) to pass each stored value through the
//! [`STORE_GUARD`] filter ([`store_guard`]), which
//! - refuses a namespace anywhere in the value (in lists, maps, tuples);
//! - passes lists, maps and tuples, which never change, and opaque values
//!   (macros, functions) as they are;
//! - copies any other list- or map-like value (a lazy view such as `a + b`
//!   of lists, `ns|items`, `loop`) to a list or map of what it shows now,
//!   since a view could later show the namespace it is stored in.
//!
//! The rewrite finds the `set` statements as minijinja's lexer does (the
//! same tag delimiters, comments, raw blocks, strings and bracket nesting),
//! and a `set` statement it cannot read fails the template's compilation.

use std::any::Any;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock, Weak};

use minijinja::value::{ObjectRepr, Tuple};
use minijinja::{Environment, ErrorKind, State, Value};

use super::bounds::bound_exceeded;

/// The map type of minijinja's values (with its `preserve_order` feature).
pub(super) type ValueMap = indexmap::IndexMap<Value, Value>;

/// Name of the filter every value stored in a namespace goes through; no
/// template names it, so the rewrite cannot clash with the template's own.
pub(super) const STORE_GUARD: &str = "__qwen3_wgpu_namespace_store_guard__";

/// Deepest value the guard walks (values this deep are built step by step
/// through namespaces, where each step is walked once).
const MAX_STORED_DEPTH: usize = 10_000;

/// Most items the guard copies out of one lazy view.
const MAX_COPIED_ITEMS: usize = 1 << 20;

// ---------------------------------------------------------------- the rewrite

/// `source` with the value of every `set` statement that stores into a
/// namespace attribute passed through [`STORE_GUARD`]:
/// `{% set ns.a = EXPR %}` becomes `{% set ns.a = (EXPR)|guard %}` and
/// `{% set ns.a | f %}` becomes `{% set ns.a | f|guard %}`. `None` when
/// there is no such statement; an error (what could not be read) when the
/// source does not lex as minijinja lexes it or a `set` statement does not
/// parse. Call it on sources that compile: it reads tags, not the grammar.
pub(super) fn guard_namespace_stores(source: &str) -> Result<Option<String>, String> {
    // minijinja drops one trailing newline before lexing.
    let mut lexed = source.strip_suffix('\n').unwrap_or(source);
    lexed = lexed.strip_suffix('\r').unwrap_or(lexed);
    let mut scanner = Scanner { src: lexed, at: 0, bracket_depth: 0 };
    let mut inserts = Vec::new();
    while let Some(tag) = scanner.next_block_tag()? {
        inserts.extend(store_guard_inserts(&tag)?);
    }
    if inserts.is_empty() {
        return Ok(None);
    }
    let mut guarded = String::with_capacity(source.len() + inserts.len() * (STORE_GUARD.len() + 3));
    let mut at = 0;
    for (offset, text) in inserts {
        guarded.push_str(&source[at..offset]);
        guarded.push_str(&text);
        at = offset;
    }
    guarded.push_str(&source[at..]);
    Ok(Some(guarded))
}

/// The insertions (offset, text) that guard the value the block tag
/// `tokens` stores, when it is a `set` statement with an attribute target.
fn store_guard_inserts(tokens: &[Token<'_>]) -> Result<Vec<(usize, String)>, String> {
    if tokens[0].kind != Kind::Ident("set") {
        return Ok(Vec::new());
    }
    let mut at = 1;
    let mut stores_attribute = false;
    assignment_target(tokens, &mut at, &mut stores_attribute, 0)?;
    if !stores_attribute {
        return Ok(Vec::new());
    }
    let end = tokens[tokens.len() - 1].start;
    match tokens[at].kind {
        Kind::Punct(b'=') => Ok(vec![(tokens[at].end, "(".into()), (end, format!(")|{STORE_GUARD}"))]),
        // The block form: the captured text, through its filters.
        Kind::Punct(b'|') | Kind::End => Ok(vec![(end, format!("|{STORE_GUARD}"))]),
        _ => Err(format!("a set statement at byte {} without `=` after its target", tokens[0].start)),
    }
}

/// Reads the target of a `set` statement from `tokens[*at]` on, as
/// minijinja's parser reads it (names, dotted attributes, commas,
/// parentheses), noting whether it names an attribute.
fn assignment_target(
    tokens: &[Token<'_>],
    at: &mut usize,
    stores_attribute: &mut bool,
    depth: usize,
) -> Result<(), String> {
    let unreadable =
        |token: &Token<'_>| format!("a set statement with a target it cannot read at byte {}", token.start);
    if depth > 64 {
        return Err(unreadable(&tokens[*at]));
    }
    let mut first = true;
    loop {
        if !first {
            if tokens[*at].kind != Kind::Punct(b',') {
                return Err(unreadable(&tokens[*at]));
            }
            *at += 1;
        }
        first = false;
        if matches!(tokens[*at].kind, Kind::Punct(b')') | Kind::End | Kind::Ident("in")) {
            break;
        }
        if tokens[*at].kind == Kind::Punct(b'(') {
            *at += 1;
            assignment_target(tokens, at, stores_attribute, depth + 1)?;
            if tokens[*at].kind != Kind::Punct(b')') {
                return Err(unreadable(&tokens[*at]));
            }
            *at += 1;
        } else {
            if !matches!(tokens[*at].kind, Kind::Ident(_)) {
                return Err(unreadable(&tokens[*at]));
            }
            *at += 1;
            while tokens[*at].kind == Kind::Punct(b'.') {
                *at += 1;
                if !matches!(tokens[*at].kind, Kind::Ident(_)) {
                    return Err(unreadable(&tokens[*at]));
                }
                *at += 1;
                *stores_attribute = true;
            }
        }
        if tokens[*at].kind != Kind::Punct(b',') {
            break;
        }
    }
    Ok(())
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind<'s> {
    Ident(&'s str),
    /// A one-byte operator or bracket.
    Punct(u8),
    /// A string, a number or a two-byte operator.
    Other,
    /// The tag's end marker (with its whitespace control).
    End,
}

#[derive(Clone, Copy, Debug)]
struct Token<'s> {
    kind: Kind<'s>,
    start: usize,
    end: usize,
}

/// minijinja's lexer (default delimiters, no line statements), reduced to
/// finding tags and the tokens of block tags.
struct Scanner<'s> {
    src: &'s str,
    at: usize,
    /// Open brackets: as in minijinja, an end marker inside brackets is
    /// not one, and the count runs on across tags.
    bracket_depth: isize,
}

impl<'s> Scanner<'s> {
    /// The tokens of the next block tag, its end marker last; skips
    /// comments, raw blocks and variable tags.
    fn next_block_tag(&mut self) -> Result<Option<Vec<Token<'s>>>, String> {
        let bytes = self.src.as_bytes();
        loop {
            let Some((start, marker)) = self.next_start_marker() else {
                return Ok(None);
            };
            let skip = 2 + usize::from(matches!(bytes.get(start + 2), Some(b'-' | b'+')));
            self.at = start + skip;
            match marker {
                b'#' => {
                    let end = self.src[self.at..].find("#}").ok_or("a comment that does not end")?;
                    self.at += end + 2;
                }
                b'{' => while self.token(b"}}")?.kind != Kind::End {},
                _ => {
                    if let Some(len) = basic_tag_len(&self.src[self.at..], "raw", false) {
                        self.at += len;
                        self.skip_raw_block()?;
                        continue;
                    }
                    let mut tokens = Vec::new();
                    loop {
                        let token = self.token(b"%}")?;
                        tokens.push(token);
                        if token.kind == Kind::End {
                            return Ok(Some(tokens));
                        }
                    }
                }
            }
        }
    }

    /// Where the next `{{`, `{%` or `{#` starts, and its second byte.
    fn next_start_marker(&self) -> Option<(usize, u8)> {
        let bytes = self.src.as_bytes();
        let mut from = self.at;
        loop {
            let at = from + bytes.get(from..)?.iter().position(|&b| b == b'{')?;
            match bytes.get(at + 1) {
                Some(&marker @ (b'{' | b'%' | b'#')) => return Some((at, marker)),
                _ => from = at + 1,
            }
        }
    }

    /// Skips past the `{% endraw %}` that ends the raw block starting at
    /// `self.at`.
    fn skip_raw_block(&mut self) -> Result<(), String> {
        let mut from = self.at;
        while let Some(at) = self.src[from..].find("{%") {
            from += at + 2;
            if let Some(len) = basic_tag_len(&self.src[from..], "endraw", true) {
                self.at = from + len;
                return Ok(());
            }
        }
        Err("a raw block that does not end".into())
    }

    /// The next token of a tag ending in `end` (`%}` or `}}`).
    fn token(&mut self, end: &[u8]) -> Result<Token<'s>, String> {
        let bytes = self.src.as_bytes();
        while bytes.get(self.at).is_some_and(u8::is_ascii_whitespace) {
            self.at += 1;
        }
        let start = self.at;
        let rest = &bytes[start..];
        if rest.is_empty() {
            return Err(format!("a tag at byte {start} that does not end"));
        }
        if self.bracket_depth == 0 {
            let control = usize::from(matches!(rest[0], b'-' | b'+'));
            if rest[control..].starts_with(end) {
                self.at = start + control + end.len();
                return Ok(Token { kind: Kind::End, start, end: self.at });
            }
        }
        let (kind, len) = match rest {
            [b'/', b'/', ..] | [b'*', b'*', ..] | [b'=' | b'!' | b'>' | b'<', b'=', ..] => (Kind::Other, 2),
            [c @ (b'(' | b'[' | b'{'), ..] => {
                self.bracket_depth += 1;
                (Kind::Punct(*c), 1)
            }
            [c @ (b')' | b']' | b'}'), ..] => {
                self.bracket_depth -= 1;
                (Kind::Punct(*c), 1)
            }
            [c
            @ (b'+' | b'-' | b'*' | b'/' | b'%' | b'.' | b',' | b':' | b'~' | b'|' | b'=' | b'>' | b'<'), ..] => {
                (Kind::Punct(*c), 1)
            }
            [quote @ (b'\'' | b'"'), ..] => {
                (Kind::Other, string_len(rest, *quote).ok_or("a string that does not end")?)
            }
            [digit, ..] if digit.is_ascii_digit() => (Kind::Other, number_len(bytes, start)),
            _ => match identifier_len(rest) {
                0 => return Err(format!("an unexpected character at byte {start}")),
                len => (Kind::Ident(&self.src[start..start + len]), len),
            },
        };
        self.at = start + len;
        Ok(Token { kind, start, end: self.at })
    }
}

/// The length of the tag body `{% name %}` (after its `{%`) at the start
/// of `s`, as minijinja recognises `raw` and `endraw`.
fn basic_tag_len(s: &str, name: &str, skip_control: bool) -> Option<usize> {
    let mut rest = s;
    if skip_control {
        rest = rest.strip_prefix(['-', '+']).unwrap_or(rest);
    }
    rest = rest.trim_start_matches(|c: char| c.is_ascii_whitespace()).strip_prefix(name)?;
    rest = rest.trim_start_matches(|c: char| c.is_ascii_whitespace());
    rest = rest.strip_prefix(['-', '+']).unwrap_or(rest);
    rest.starts_with("%}").then(|| s.len() - rest.len() + 2)
}

/// The length of the string literal quoted by `quote` at the start of
/// `rest`, backslash escapes included.
fn string_len(rest: &[u8], quote: u8) -> Option<usize> {
    let mut escaped = false;
    for (i, &b) in rest.iter().enumerate().skip(1) {
        if escaped {
            escaped = false;
        } else if b == b'\\' {
            escaped = true;
        } else if b == quote {
            return Some(i + 1);
        }
    }
    None
}

/// The length of an identifier at the start of `rest`: ASCII letters,
/// digits and `_` as minijinja lexes them, and any non-ASCII character
/// (minijinja accepts some with its `unicode` feature and refuses the
/// template otherwise, so this only matters for templates that compile).
fn identifier_len(rest: &[u8]) -> usize {
    let ident = |b: u8| b == b'_' || b.is_ascii_alphanumeric() || !b.is_ascii();
    match rest.first() {
        Some(&b) if ident(b) && !b.is_ascii_digit() => rest.iter().take_while(|&&b| ident(b)).count(),
        _ => 0,
    }
}

/// The length of the number literal at `bytes[start]`, as minijinja's
/// lexer reads it (`0x1f`, `1_000`, `1.5e-3`; `x.0.1` indexes twice).
fn number_len(bytes: &[u8], start: usize) -> usize {
    #[derive(Clone, Copy)]
    enum Part {
        RadixInteger,
        Integer,
        Fraction,
        Exponent,
        ExponentSign,
    }
    let after_dot = start > 0 && bytes[start - 1] == b'.';
    let (radix, prefix) = match bytes.get(start..start + 2) {
        Some(b"0b" | b"0B") => (2, 2),
        Some(b"0o" | b"0O") => (8, 2),
        Some(b"0x" | b"0X") => (16, 2),
        _ => (10, 0),
    };
    let body = &bytes[start + prefix..];
    let mut part = if radix == 10 { Part::Integer } else { Part::RadixInteger };
    let mut len = body.iter().take_while(|b| b.is_ascii_digit()).count();
    for &c in &body[len..] {
        part = match (c, part) {
            (b'.', Part::Integer) if after_dot => break,
            (b'.', Part::Integer) => {
                let exponent = matches!(body.get(len + 1), Some(b'e' | b'E'))
                    && matches!(body.get(len + 2), Some(b'+' | b'-' | b'0'..=b'9'));
                if !exponent && identifier_len(&body[len + 1..]) > 0 {
                    break;
                }
                Part::Fraction
            }
            (b'E' | b'e', Part::Integer | Part::Fraction) => Part::Exponent,
            (b'+' | b'-', Part::Exponent) => Part::ExponentSign,
            (b'0'..=b'9', Part::Exponent) => Part::ExponentSign,
            (b'0'..=b'9', part) => part,
            (b'a'..=b'f' | b'A'..=b'F', Part::RadixInteger) if radix == 16 => part,
            (b'_', part) => part,
            _ => break,
        };
        len += 1;
    }
    prefix + len
}

// ---------------------------------------------------------------- the guard

/// The error the guard attaches when a template stores a namespace in a
/// namespace, to tell it from other failures.
#[derive(Debug)]
struct NamespaceStored;

impl std::fmt::Display for NamespaceStored {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a namespace cannot be stored inside a namespace")
    }
}

impl std::error::Error for NamespaceStored {}

/// Whether `e` (or an error it wraps) is the guard refusing a namespace.
pub(super) fn namespace_stored(e: &minijinja::Error) -> bool {
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        if s.is::<NamespaceStored>() {
            return true;
        }
        source = s.source();
    }
    false
}

/// The [`STORE_GUARD`] filter: `value` as a namespace may hold it (itself,
/// or a copy of a lazy view); an error when it holds a namespace.
pub(super) fn store_guard(state: &mut State, value: Value) -> Result<Value, minijinja::Error> {
    let frozen = state.get_or_insert_extension_with(FrozenValues::default);
    Ok(freeze(&value, frozen, 0)?.unwrap_or(value))
}

/// The lists, maps and tuples of one render found to hold no namespace
/// and no view: they never change, so each is walked once. Held weakly (a
/// weak reference also keeps the address from being reused).
#[derive(Default)]
struct FrozenValues {
    by_address: HashMap<usize, Weak<dyn Any + Send + Sync>>,
    /// Entries after the last sweep of dropped values.
    after_sweep: usize,
}

impl FrozenValues {
    fn holds<T: Any + Send + Sync>(&self, value: &Arc<T>) -> bool {
        self.by_address.contains_key(&(Arc::as_ptr(value) as *const () as usize))
    }

    fn insert<T: Any + Send + Sync>(&mut self, value: &Arc<T>) {
        if self.by_address.len() >= 2 * self.after_sweep + 1024 {
            self.by_address.retain(|_, weak| weak.strong_count() > 0);
            self.after_sweep = self.by_address.len();
        }
        let any: Arc<dyn Any + Send + Sync> = value.clone();
        self.by_address.insert(Arc::as_ptr(value) as *const () as usize, Arc::downgrade(&any));
    }

    /// Notes `value`, a list, map or tuple found frozen, or its frozen
    /// `copy`; returns the copy.
    fn record(&mut self, value: &Value, copy: Option<Value>) -> Option<Value> {
        let frozen = copy.as_ref().unwrap_or(value);
        if let Some(list) = frozen.downcast_object::<Vec<Value>>() {
            self.insert(&list);
        } else if let Some(map) = frozen.downcast_object::<ValueMap>() {
            self.insert(&map);
        } else if let Some(tuple) = frozen.downcast_object::<Tuple>() {
            self.insert(&tuple);
        }
        copy
    }
}

/// Type names of minijinja's objects the guard tells apart by name (their
/// types are private): a name that cannot be learnt matches nothing, and
/// the guard then copies such a value (a namespace too) instead of
/// passing it.
pub(super) struct KnownTypes {
    pub(super) namespace: &'static str,
    pub(super) macro_object: &'static str,
}

pub(super) fn known_types() -> &'static KnownTypes {
    static KNOWN: OnceLock<KnownTypes> = OnceLock::new();
    KNOWN.get_or_init(|| {
        let type_name = |value: &Value| value.as_object().map_or("", |o| o.type_name());
        let namespace = minijinja::functions::namespace(None).map_or("", |ns| type_name(&ns));
        let seen: Arc<Mutex<&'static str>> = Arc::default();
        let mut env = Environment::new();
        let record = seen.clone();
        env.add_function("probe", move |value: Value| {
            *record.lock().unwrap_or_else(|e| e.into_inner()) = type_name(&value);
            Value::UNDEFINED
        });
        let _ = env.render_str("{% macro m() %}{% endmacro %}{{ probe(m) }}", ());
        let macro_object = *seen.lock().unwrap_or_else(|e| e.into_inner());
        KnownTypes { namespace, macro_object }
    })
}

/// `value` as a namespace may hold it: `None` when it may be stored as it
/// is, else a copy that may; an error when it holds a namespace.
fn freeze(value: &Value, frozen: &mut FrozenValues, depth: usize) -> Result<Option<Value>, minijinja::Error> {
    let Some(object) = value.as_object() else {
        return Ok(None);
    };
    let known = known_types();
    if object.type_name() == known.namespace {
        return Err(minijinja::Error::new(ErrorKind::InvalidOperation, NamespaceStored.to_string())
            .with_source(NamespaceStored));
    }
    if depth > MAX_STORED_DEPTH {
        return Err(bound_exceeded(format!(
            "{MAX_STORED_DEPTH} levels of nesting in a value stored in a namespace"
        )));
    }
    if let Some(list) = value.downcast_object::<Vec<Value>>() {
        if frozen.holds(&list) {
            return Ok(None);
        }
        let copy = freeze_slice(&list, frozen, depth)?.map(Value::from);
        return Ok(frozen.record(value, copy));
    }
    if let Some(tuple) = value.downcast_object::<Tuple>() {
        if frozen.holds(&tuple) {
            return Ok(None);
        }
        let copy = freeze_slice(&tuple, frozen, depth)?.map(|items| Value::from(Tuple::from(items)));
        return Ok(frozen.record(value, copy));
    }
    if let Some(map) = value.downcast_object::<ValueMap>() {
        if frozen.holds(&map) {
            return Ok(None);
        }
        let copy = freeze_map(&map, frozen, depth)?.map(Value::from_pairs);
        return Ok(frozen.record(value, copy));
    }
    if object.type_name() == known.macro_object {
        return Ok(None);
    }
    let copy = match object.repr() {
        ObjectRepr::Plain => return Ok(None),
        ObjectRepr::Seq | ObjectRepr::Iterable => {
            let mut items = Vec::new();
            for item in object.try_iter().into_iter().flatten() {
                check_copied(items.len())?;
                items.push(freeze(&item, frozen, depth + 1)?.unwrap_or(item));
            }
            Value::from(items)
        }
        ObjectRepr::Map => {
            let mut pairs = Vec::new();
            for (key, item) in object.try_iter_pairs().into_iter().flatten() {
                check_copied(pairs.len())?;
                let key = freeze(&key, frozen, depth + 1)?.unwrap_or(key);
                pairs.push((key, freeze(&item, frozen, depth + 1)?.unwrap_or(item)));
            }
            Value::from_pairs(pairs)
        }
        _ => {
            return Err(minijinja::Error::new(
                ErrorKind::InvalidOperation,
                format!("a {} cannot be stored in a namespace", value.kind()),
            ))
        }
    };
    Ok(frozen.record(value, Some(copy)))
}

/// `items` with each item frozen: `None` when all may be stored as they
/// are.
fn freeze_slice(
    items: &[Value],
    frozen: &mut FrozenValues,
    depth: usize,
) -> Result<Option<Vec<Value>>, minijinja::Error> {
    let mut copy: Option<Vec<Value>> = None;
    for (i, item) in items.iter().enumerate() {
        let changed = freeze(item, frozen, depth + 1)?;
        match (&mut copy, changed) {
            (Some(copy), changed) => copy.push(changed.unwrap_or_else(|| item.clone())),
            (None, Some(changed)) => {
                let mut started = items[..i].to_vec();
                started.push(changed);
                copy = Some(started);
            }
            (None, None) => {}
        }
    }
    Ok(copy)
}

/// `map` with each key and value frozen: `None` when all may be stored as
/// they are.
fn freeze_map(
    map: &ValueMap,
    frozen: &mut FrozenValues,
    depth: usize,
) -> Result<Option<Vec<(Value, Value)>>, minijinja::Error> {
    let mut copy: Option<Vec<(Value, Value)>> = None;
    for (i, (key, item)) in map.iter().enumerate() {
        let changed = (freeze(key, frozen, depth + 1)?, freeze(item, frozen, depth + 1)?);
        match (&mut copy, changed) {
            (Some(copy), (k, v)) => {
                copy.push((k.unwrap_or_else(|| key.clone()), v.unwrap_or_else(|| item.clone())))
            }
            (None, (None, None)) => {}
            (None, (k, v)) => {
                let mut started: Vec<(Value, Value)> =
                    map.iter().take(i).map(|(k, v)| (k.clone(), v.clone())).collect();
                started.push((k.unwrap_or_else(|| key.clone()), v.unwrap_or_else(|| item.clone())));
                copy = Some(started);
            }
        }
    }
    Ok(copy)
}

/// Refuses a copy of a lazy view past [`MAX_COPIED_ITEMS`] (a view can be
/// endless, `range(10**12)`).
fn check_copied(len: usize) -> Result<(), minijinja::Error> {
    if len >= MAX_COPIED_ITEMS {
        return Err(bound_exceeded(format!(
            "{MAX_COPIED_ITEMS} items copied into a namespace from one value"
        )));
    }
    Ok(())
}
