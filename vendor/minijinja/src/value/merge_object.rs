use std::collections::BTreeSet;
use std::fmt;
use std::sync::Arc;

use crate::value::ops::LenIterWrap;
use crate::value::{Enumerator, Object, ObjectExt, ObjectRepr, Value, ValueKind, ValueRepr};

/// Dictionary merging behavior - create custom object with lookup capability
#[derive(Debug)]
pub struct MergeDict {
    values: Box<[Value]>,
}

impl MergeDict {
    /// Most maps one merged map may look through (see [`MergeDict::flat`]).
    pub(crate) const MAX_MERGED: usize = 256;

    pub fn new(values: Vec<Value>) -> Self {
        Self {
            values: values.into_boxed_slice(),
        }
    }

    /// A merge of `values` that looks through no other merge: merged maps
    /// among `values` are replaced by the maps they merge, and a map met
    /// more than once is kept at its last place only (lookups search from
    /// the end, so an earlier copy of the same map never answers).  Without
    /// this, `d = d|chain(d)` repeated n times makes a lookup visit 2^n
    /// maps.  `None` when more than [`MergeDict::MAX_MERGED`] maps remain.
    pub(crate) fn flat(values: &[Value]) -> Option<Self> {
        let mut leaves = Vec::new();
        for value in values {
            match value.downcast_object_ref::<Self>() {
                Some(merged) => leaves.extend(merged.values.iter().cloned()),
                None => leaves.push(value.clone()),
            }
            if leaves.len() > 2 * Self::MAX_MERGED {
                leaves = Self::last_of_each(leaves);
                if leaves.len() > Self::MAX_MERGED {
                    return None;
                }
            }
        }
        let leaves = Self::last_of_each(leaves);
        if leaves.len() > Self::MAX_MERGED {
            return None;
        }
        Some(Self::new(leaves))
    }

    /// `values` with each one kept at its last place only (same object, or
    /// equal primitive value).
    fn last_of_each(values: Vec<Value>) -> Vec<Value> {
        let mut kept: Vec<Value> = Vec::with_capacity(values.len());
        for value in values.into_iter().rev() {
            if !kept.iter().any(|k| same_object(k, &value)) {
                kept.push(value);
            }
        }
        kept.reverse();
        kept
    }
}

impl Object for MergeDict {
    fn get_value(self: &Arc<Self>, key: &Value) -> Option<Value> {
        // Look up key in reverse order (last matching dict wins)
        for value in self.values.iter().rev() {
            if let Ok(v) = value.get_item(key) {
                if !v.is_undefined() {
                    return Some(v);
                }
            }
        }
        None
    }

    fn enumerate(self: &Arc<Self>) -> Enumerator {
        // Collect all keys from all dictionaries (only include maps)
        let mut keys = BTreeSet::new();
        for key in self
            .values
            .iter()
            .filter(|x| x.kind() == ValueKind::Map)
            .filter_map(|v| v.try_iter().ok())
            .flatten()
        {
            keys.insert(key);
        }
        Enumerator::Iter(Box::new(keys.into_iter()))
    }
}

/// Whether `a` and `b` are the same object.
fn same_object(a: &Value, b: &Value) -> bool {
    match (&a.0, &b.0) {
        (ValueRepr::Object(a), ValueRepr::Object(b)) => a.is_same_object(b),
        _ => false,
    }
}

/// List merging behavior - calculate total length for size hint
pub struct MergeSeq {
    values: Box<[Value]>,
    /// For each value, the total length of the values before it (all sized
    /// values only): an index finds its value by binary search.
    starts: Option<Box<[usize]>>,
    total_len: Option<usize>,
    repr: ObjectRepr,
    depth: usize,
    /// How many values flattening this merge would yield (saturating): a
    /// merge of merges shares them, so this can grow as 2^depth.
    leaves: u64,
}

impl fmt::Debug for MergeSeq {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("<iterator>").finish()
    }
}

impl MergeSeq {
    pub(crate) const MAX_DEPTH: usize = 32;

    #[cfg(feature = "builtins")]
    pub fn new(values: Vec<Value>) -> Self {
        Self::with_repr(values, ObjectRepr::Seq)
    }

    pub(crate) fn new_iterable(values: Vec<Value>) -> Self {
        Self::with_repr(values, ObjectRepr::Iterable)
    }

    fn with_repr(mut values: Vec<Value>, repr: ObjectRepr) -> Self {
        let mut depth = Self::depth_for_values(&values);
        if depth > Self::MAX_DEPTH {
            let mut flattened = Vec::new();
            for value in values.iter() {
                Self::push_flattened_value(value, &mut flattened);
            }
            values = flattened;
            depth = Self::depth_for_values(&values);
        }

        let mut starts = Vec::with_capacity(values.len());
        let mut total_len = Some(0usize);
        for value in values.iter() {
            if let Some(len) = total_len {
                starts.push(len);
            }
            total_len = match (total_len, value.len()) {
                (Some(total), Some(len)) => total.checked_add(len),
                _ => None,
            };
        }
        Self {
            starts: total_len.map(|_| starts.into_boxed_slice()),
            total_len,
            leaves: Self::leaves_for_values(&values),
            values: values.into_boxed_slice(),
            repr,
            depth,
        }
    }

    /// How many values flattening a merge of `values` would yield.
    pub(crate) fn leaves_for_values(values: &[Value]) -> u64 {
        values.iter().fold(0u64, |sum, value| {
            sum.saturating_add(
                value
                    .downcast_object_ref::<Self>()
                    .map_or(1, |seq| seq.leaves),
            )
        })
    }

    /// What materialising or flattening a merge of `values` would allocate,
    /// in fuel units (`slot_cost` per list slot); 0 when a merge of them
    /// stays lazy.
    pub(crate) fn merge_alloc_estimate(values: &[Value], slot_cost: u64) -> u64 {
        if Self::depth_for_values(values) <= Self::MAX_DEPTH {
            return 0;
        }
        let sized = values.iter().try_fold(0u64, |sum, value| {
            Some(sum.saturating_add(value.len()? as u64))
        });
        sized
            .unwrap_or(0)
            .max(Self::leaves_for_values(values))
            .saturating_mul(slot_cost)
    }

    pub(crate) fn depth_for_values(values: &[Value]) -> usize {
        values
            .iter()
            .filter_map(|value| value.downcast_object_ref::<Self>())
            .map(|seq| seq.depth)
            .max()
            .unwrap_or(0)
            .saturating_add(1)
    }

    fn push_flattened_value(value: &Value, values: &mut Vec<Value>) {
        let mut pending = vec![value.clone()];
        while let Some(value) = pending.pop() {
            if let Some(seq) = value.downcast_object_ref::<Self>() {
                pending.extend(seq.values.iter().rev().cloned());
            } else {
                values.push(value);
            }
        }
    }
}

impl Object for MergeSeq {
    fn repr(self: &Arc<Self>) -> ObjectRepr {
        self.repr
    }

    fn get_value(self: &Arc<Self>, key: &Value) -> Option<Value> {
        if self.repr != ObjectRepr::Seq {
            return None;
        }

        let (idx, starts, total_len) = (key.as_usize()?, self.starts.as_ref()?, self.total_len?);
        if idx >= total_len {
            return None;
        }
        // The last value starting at or before `idx` (empty values share
        // their start with the next one).
        let at = starts.partition_point(|&start| start <= idx) - 1;
        self.values[at]
            .get_item(&Value::from(idx - starts[at]))
            .ok()
    }

    fn enumerate(self: &Arc<Self>) -> Enumerator {
        self.mapped_enumerator(|this| {
            let iter = this.values.iter().flat_map(|v| match v.try_iter() {
                Ok(iter) => Box::new(iter) as Box<dyn Iterator<Item = Value> + Send + Sync>,
                Err(err) => Box::new(Some(Value::from(err)).into_iter())
                    as Box<dyn Iterator<Item = Value> + Send + Sync>,
            });
            if let Some(total_len) = this.total_len {
                Box::new(LenIterWrap(total_len, iter))
            } else {
                Box::new(iter)
            }
        })
    }
}

/// Utility function to merge multiple maps into a single one.
///
/// If values are passed that are not maps, they are for the most part ignored.
/// They cannot be enumerated, but attribute lookups can still work.   That's
/// because [`get_value`](crate::value::Object::get_value) is forwarded through
/// to all objects.
///
/// This is the operation the [`context!`](crate::context) macro uses behind
/// the scenes.  The merge is done lazily which means that any dynamic object
/// that behaves like a map can be used here.  Note though that the order of
/// this function is inverse to what the macro does.
///
/// ```
/// use minijinja::{context, value::merge_maps};
///
/// let ctx1 = context!{
///     name => "John",
///     age => 30
/// };
///
/// let ctx2 = context!{
///     location => "New York",
///     age => 25  // This will be overridden by ctx1's value
/// };
///
/// let merged = merge_maps([ctx1, ctx2]);
/// ```
pub fn merge_maps<I, V>(iter: I) -> Value
where
    I: IntoIterator<Item = V>,
    V: Into<Value>,
{
    let sources: Vec<Value> = iter.into_iter().map(Into::into).collect();
    // if we only have a single source, we can use it directly to avoid making
    // an unnecessary indirection.
    if sources.len() == 1 {
        sources[0].clone()
    } else {
        Value::from_object(MergeDict::new(sources))
    }
}

#[test]
fn test_merge_object() {
    use std::collections::BTreeMap;

    let o = merge_maps([Value::from("abc"), Value::from(vec![1, 2, 3])]);
    assert_eq!(o, Value::from(BTreeMap::<String, String>::new()));

    let mut map1 = BTreeMap::new();
    map1.insert("a", 1);
    map1.insert("b", 2);

    let mut map2 = BTreeMap::new();
    map2.insert("b", 3);
    map2.insert("c", 4);

    let merged = merge_maps([Value::from(map1), Value::from(map2)]);

    // Check that the merged object contains all keys with expected values
    // The value from the latter map should be used when keys overlap
    assert_eq!(merged.get_attr("a").unwrap(), Value::from(1));
    assert_eq!(merged.get_attr("b").unwrap(), Value::from(3)); // Takes value from map2
    assert_eq!(merged.get_attr("c").unwrap(), Value::from(4));
}
