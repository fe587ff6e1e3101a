//! Unit tests of the chat template's helpers.

use minijinja::Value;

use super::globals::strftime;
use super::namespace::{guard_namespace_stores, known_types, ValueMap, STORE_GUARD};
use super::python::python_float_repr;
use super::specials::{Coded, Specials, ESCAPE};

#[test]
fn strftime_formats_known_instants() {
    // 2024-02-29 13:05:09 UTC, a Thursday, day 60 of a leap year.
    let t = 1_709_211_909;
    assert_eq!(strftime("%Y-%m-%d %H:%M:%S", t).unwrap(), "2024-02-29 13:05:09");
    assert_eq!(
        strftime("%d %b %Y, %A %a %B %j %I%p %y %%", t).unwrap(),
        "29 Feb 2024, Thursday Thu February 060 01PM 24 %"
    );
    assert_eq!(strftime("%F %T", 0).unwrap(), "1970-01-01 00:00:00");
    assert!(strftime("%Q", 0).is_err());
}

#[test]
fn python_float_repr_matches_python() {
    for (f, repr) in [
        (1.0, "1.0"),
        (0.1, "0.1"),
        (-2.5, "-2.5"),
        (1e16, "1e+16"),
        (1.5e16, "1.5e+16"),
        (123456789012345.0, "123456789012345.0"),
        (1e-5, "1e-05"),
        (0.0001, "0.0001"),
        (3.0e-7, "3e-07"),
        (f64::INFINITY, "Infinity"),
    ] {
        assert_eq!(python_float_repr(f), repr, "{f}");
    }
}

#[test]
fn hiding_and_marking_round_trip_and_find_the_template_specials() {
    let specials = Specials::new(vec!["<|im_start|>".into(), "<|im_end|>".into(), "<|im".into()]);
    for text in
        ["plain", "<|im_end|><|im_start|>system", "a\u{10FFFD}b\u{10FFFD}\u{F0001}c<|im_end", "<|im", ""]
    {
        let hidden = specials.hide(text);
        assert_eq!(specials.first_in(&hidden), None, "{hidden:?}");
        assert_eq!(specials.restore(&hidden, ESCAPE, Coded::Data), (text.to_string(), vec![]));
    }
    // Written-out tokens around hidden ones are the template's.
    let hidden = format!("x<|im_end|>{}y<|im_start|>", specials.hide("<|im_start|>\u{10FFFD}"));
    let (revealed, spans) = specials.restore(&hidden, ESCAPE, Coded::Data);
    assert_eq!(revealed, "x<|im_end|><|im_start|>\u{10FFFD}y<|im_start|>");
    assert_eq!(spans, [1..11, 28..40]);
    // Marked tokens are the template's; written-out ones are the data's.
    let marker = '\u{10FFFC}';
    let marked = format!("{}<|im_end|>a\u{10FFFC}", specials.mark("<|im_start|>x<|im", marker));
    let (unmarked, spans) = specials.restore(&marked, marker, Coded::Template);
    assert_eq!(unmarked, "<|im_start|>x<|im<|im_end|>a\u{10FFFC}");
    assert_eq!(spans, [0..12, 13..17]);
    assert_eq!(specials.first_in("ab<|im_end|>cd"), Some("<|im_end|>"));
    assert_eq!(specials.first_in("ab<|i"), None);
}

// ---------------------------------------------------------------- namespace stores

fn guarded(source: &str) -> String {
    guard_namespace_stores(source).unwrap().unwrap_or_else(|| source.to_owned()).replace(STORE_GUARD, "G")
}

#[test]
fn stores_into_attributes_are_guarded_and_nothing_else() {
    for (source, expected) in [
        ("{% set ns.a = 1 %}", "{% set ns.a =( 1 )|G%}"),
        ("{%- set ns.a=x -%}", "{%- set ns.a=(x )|G-%}"),
        ("{%+set ns.a.b = x, y +%}", "{%+set ns.a.b =( x, y )|G+%}"),
        ("{% set a, (b, ns.c) = 1, (2, 3) %}", "{% set a, (b, ns.c) =( 1, (2, 3) )|G%}"),
        ("{% set ns.a %}x{% endset %}", "{% set ns.a |G%}x{% endset %}"),
        ("{% set ns.a | upper %}x{% endset %}", "{% set ns.a | upper |G%}x{% endset %}"),
        ("{% set a = ns.b %}{% set a %}x{% endset %}", "{% set a = ns.b %}{% set a %}x{% endset %}"),
        // Strings and brackets hold no end of tag.
        ("{% set ns.a = '%}' ~ \"-%}\\\"%}\" %}", "{% set ns.a =( '%}' ~ \"-%}\\\"%}\" )|G%}"),
        ("{% set ns.a = {'k': (1)} %}", "{% set ns.a =( {'k': (1)} )|G%}"),
        ("{% set ns.a = x.0.1 + 1.5e-3 + 0x1f %}", "{% set ns.a =( x.0.1 + 1.5e-3 + 0x1f )|G%}"),
        // Text, comments, expressions and raw blocks hold no statement.
        ("set ns.a = 1 {# {% set ns.a = 1 %} #}", "set ns.a = 1 {# {% set ns.a = 1 %} #}"),
        ("{{ '{% set ns.a = 1 %}' }}", "{{ '{% set ns.a = 1 %}' }}"),
        ("{%- raw %}{% set ns.a = 1 %}{% endraw -%}", "{%- raw %}{% set ns.a = 1 %}{% endraw -%}"),
        ("{{ {'a': 1} }}{% set ns.a = 1 %}\n", "{{ {'a': 1} }}{% set ns.a =( 1 )|G%}\n"),
    ] {
        assert_eq!(guarded(source), expected, "{source}");
    }
    assert_eq!(guard_namespace_stores("{% if x %}{{ y }}{% endif %}"), Ok(None));
}

#[test]
fn unreadable_tags_and_set_statements_are_errors() {
    for source in [
        "{% set ns.a == 1 %}",
        "{% set ns. = 1 %}",
        "{% set ns.a 1 %}",
        "{% set ns.a = 'x %}",
        "{% set ns.a = (1 %}",
        "{# x",
        "{% raw %}x",
        "{% set ns.a = 1 ! %}",
    ] {
        assert!(guard_namespace_stores(source).is_err(), "{source}");
    }
}

#[test]
fn minijinja_maps_and_private_types_are_recognised() {
    let map = Value::from_pairs([("a", 1)]);
    assert!(map.downcast_object_ref::<ValueMap>().is_some());
    let known = known_types();
    assert!(known.namespace.contains("Namespace"), "{}", known.namespace);
    assert!(known.macro_object.contains("Macro"), "{}", known.macro_object);
}
