//! Settings: the precedence of explicit arguments, `OFFLOAD_*` variables, the TOML file and preset defaults;
//! every bad key and value as a typed error; the documented table.

use expect_test::{Expect, expect};
use offload_core::plan::{
    KEYS, Kind, MAX_PREFETCH_DEPTH, Origin, PlanError, Preset, Settings, SettingsLayer, settings_table,
};

fn check(actual: String, expect: Expect) {
    expect.assert_eq(&actual);
}

fn no_env() -> std::iter::Empty<(String, String)> {
    std::iter::empty()
}

fn env(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
    pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
}

/// A valid value of each kind as text, a second one, and the same two as TOML.
fn samples(kind: Kind) -> [(&'static str, &'static str); 2] {
    match kind {
        Kind::Preset => [("low_ram_safe", "\"low_ram_safe\""), ("no_pin", "\"no_pin\"")],
        Kind::Size => [("4GiB", "\"4GiB\""), ("1000", "1000")],
        Kind::Bool => [("false", "false"), ("true", "true")],
        Kind::Count | Kind::Depth => [("3", "3"), ("2", "2")],
        Kind::Path => [("/tmp/a", "\"/tmp/a\""), ("/tmp/b", "\"/tmp/b\"")],
        Kind::Text => [("first", "\"first\""), ("second", "\"second\"")],
        Kind::Ratio => [("2.5", "2.5"), ("8", "8")],
        Kind::HostTier => [("file", "\"file\""), ("ram", "\"ram\"")],
    }
}

/// The resolved value of `key`, as text, for comparing layers.
fn value(settings: &Settings, key: &str) -> String {
    match key {
        "preset" => settings.preset.to_string(),
        "reserve" => format!("{:?}", settings.reserve),
        "resident_budget" => format!("{:?}", settings.resident_budget),
        "pinned_budget" => format!("{:?}", settings.pinned_budget),
        "prefetch" => settings.prefetch.to_string(),
        "prefetch_depth" => settings.prefetch_depth.to_string(),
        "blocks_per_group" => settings.blocks_per_group.to_string(),
        "disk_store_dir" => format!("{:?}", settings.disk_store_dir),
        "low_host_memory" => settings.low_host_memory.to_string(),
        "retry_on_oom" => settings.retry_on_oom.to_string(),
        "profile_name" => format!("{:?}", settings.profile_name),
        "profile_dir" => format!("{:?}", settings.profile_dir),
        "calibrate" => settings.calibrate.to_string(),
        "full_pin_ratio" => settings.full_pin_ratio.to_string(),
        "host_available" => format!("{:?}", settings.host_available),
        "host_tier" => settings.host_tier.name().to_string(),
        other => panic!("the test does not know key {other}"),
    }
}

#[test]
fn every_key_follows_explicit_then_env_then_file_then_default() {
    for info in KEYS {
        let [(a, a_toml), (b, _)] = samples(info.kind);
        let variable = info.variable();
        let file = format!("{} = {a_toml}\n", info.key);

        // The file alone beats the default.
        let from_file = Settings::resolve(&SettingsLayer::default(), no_env(), Some(&file)).expect("valid");
        assert_eq!(from_file.origin(info.key), Origin::File, "{}", info.key);
        let mut explicit_a = SettingsLayer::default();
        explicit_a.set(info.key, a).expect("valid");
        let expected_a = Settings::resolve(&explicit_a, no_env(), None).expect("valid");
        assert_eq!(value(&from_file, info.key), value(&expected_a, info.key), "{}", info.key);

        // The environment beats the file.
        let from_env =
            Settings::resolve(&SettingsLayer::default(), env(&[(&variable, b)]), Some(&file)).expect("valid");
        assert_eq!(from_env.origin(info.key), Origin::Environment(variable.clone()), "{}", info.key);
        let mut explicit_b = SettingsLayer::default();
        explicit_b.set(info.key, b).expect("valid");
        let expected_b = Settings::resolve(&explicit_b, no_env(), None).expect("valid");
        assert_eq!(value(&from_env, info.key), value(&expected_b, info.key), "{}", info.key);
        assert_ne!(value(&from_env, info.key), value(&from_file, info.key), "{}: samples must differ", info.key);

        // An explicit argument beats both.
        let explicit = Settings::resolve(&explicit_a, env(&[(&variable, b)]), Some(&file)).expect("valid");
        assert_eq!(explicit.origin(info.key), Origin::Explicit, "{}", info.key);
        assert_eq!(value(&explicit, info.key), value(&expected_a, info.key), "{}", info.key);

        // Nobody: the default.
        let default = Settings::resolve(&SettingsLayer::default(), no_env(), None).expect("valid");
        assert_eq!(default.origin(info.key), Origin::Default, "{}", info.key);
        assert!(!default.is_set(info.key));
    }
}

#[test]
fn the_preset_supplies_defaults_that_every_layer_overrides() {
    // no_pin turns prefetch off by default.
    let from_env =
        Settings::resolve(&SettingsLayer::default(), env(&[("OFFLOAD_PRESET", "no_pin")]), None).expect("valid");
    assert_eq!(from_env.preset, Preset::NoPin);
    assert!(!from_env.prefetch);
    assert_eq!(from_env.origin("prefetch"), Origin::Default);
    // The file turns it back on, although the preset came from the stronger environment.
    let with_file =
        Settings::resolve(&SettingsLayer::default(), env(&[("OFFLOAD_PRESET", "no_pin")]), Some("prefetch = true"))
            .expect("valid");
    assert!(with_file.prefetch);
    assert_eq!(with_file.origin("prefetch"), Origin::File);
    // Defaults with nothing set.
    let default = Settings::default();
    assert_eq!(
        (default.preset, default.prefetch, default.prefetch_depth, default.blocks_per_group),
        (Preset::Auto, true, 1, 1)
    );
    assert!(default.retry_on_oom && !default.low_host_memory && !default.calibrate);
    assert_eq!(default.full_pin_ratio, 4.0);
}

#[test]
fn low_ram_safe_spares_host_ram_by_default_and_every_layer_overrides_it() {
    // The preset's default, wherever the preset came from.
    let from_env =
        Settings::resolve(&SettingsLayer::default(), env(&[("OFFLOAD_PRESET", "low_ram_safe")]), None).expect("valid");
    assert!(from_env.low_host_memory);
    assert_eq!(from_env.origin("low_host_memory"), Origin::Default);
    assert!(!Settings::from(Preset::Auto).low_host_memory);
    // The file beats the default, the environment beats the file, an explicit argument beats both.
    let file = "preset = \"low_ram_safe\"\nlow_host_memory = false\n";
    let from_file = Settings::resolve(&SettingsLayer::default(), no_env(), Some(file)).expect("valid");
    assert_eq!((from_file.low_host_memory, from_file.origin("low_host_memory")), (false, Origin::File));
    let over_file = Settings::resolve(&SettingsLayer::default(), env(&[("OFFLOAD_LOW_HOST_MEMORY", "1")]), Some(file))
        .expect("valid");
    assert!(over_file.low_host_memory);
    let explicit = SettingsLayer { low_host_memory: Some(false), ..SettingsLayer::default() };
    let over_all = Settings::resolve(&explicit, env(&[("OFFLOAD_LOW_HOST_MEMORY", "1")]), Some(file)).expect("valid");
    assert_eq!((over_all.low_host_memory, over_all.origin("low_host_memory")), (false, Origin::Explicit));
}

#[test]
fn other_variables_are_ignored_and_the_config_variable_is_not_a_setting() {
    let settings = Settings::resolve(
        &SettingsLayer::default(),
        env(&[
            ("PATH", "/bin"),
            ("DDO_PRESET", "wsl_compat"),
            ("OFFLOAD_CONFIG", "/etc/offload.toml"),
            ("offload_preset", "x"),
        ]),
        None,
    )
    .expect("only OFFLOAD_* variables are read");
    let nothing = Settings::resolve(&SettingsLayer::default(), no_env(), None).expect("valid");
    assert_eq!(settings, nothing);
}

#[test]
fn a_bad_value_names_the_key_where_it_came_from_and_what_is_accepted() {
    let bad: &[(&str, &str)] = &[
        ("preset", "fastest"),
        ("reserve", "3 bananas"),
        ("resident_budget", "-1GB"),
        ("pinned_budget", "lots"),
        ("prefetch", "maybe"),
        ("prefetch_depth", "0"),
        ("blocks_per_group", "two"),
        ("disk_store_dir", " "),
        ("low_host_memory", "2"),
        ("retry_on_oom", "yes please"),
        ("profile_name", "my workload/1"),
        ("profile_dir", ""),
        ("calibrate", "sometimes"),
        ("full_pin_ratio", "-4"),
        ("host_available", "16 GB RAM"),
        ("host_tier", "disk"),
    ];
    assert_eq!(bad.len(), KEYS.len(), "one bad value per key");
    let mut messages = String::new();
    for (key, text) in bad {
        let info = KEYS.iter().find(|k| k.key == *key).expect("a key");
        let variable = info.variable();
        let err = Settings::resolve(&SettingsLayer::default(), env(&[(&variable, text)]), None).expect_err(key);
        match &err {
            PlanError::InvalidValue { key: named, value, origin, expected } => {
                assert_eq!(named, key);
                assert_eq!(value, text);
                assert_eq!(origin, &Origin::Environment(variable.clone()));
                assert_eq!(*expected, info.kind.expected());
            }
            other => panic!("{key}: expected InvalidValue, got {other:?}"),
        }
        // The same value passed explicitly names the explicit origin.
        let explicit = SettingsLayer::default().set(key, text).expect_err(key);
        assert!(explicit.to_string().contains("from an explicit argument"), "{explicit}");
        messages.push_str(&err.to_string());
        messages.push('\n');
    }
    check(
        messages,
        expect![[r#"
            invalid value "fastest" for setting preset from environment variable OFFLOAD_PRESET: expected one of auto, one_shot_fast, low_ram_safe, warm_process, diffusers_offload_compat, diffusers_leaf_offload_compat, no_pin, off; change it there
            invalid value "3 bananas" for setting reserve from environment variable OFFLOAD_RESERVE: expected a size such as "6GiB", "3GB" or a byte count (KB/MB/GB decimal, KiB/MiB/GiB binary); change it there
            invalid value "-1GB" for setting resident_budget from environment variable OFFLOAD_RESIDENT_BUDGET: expected a size such as "6GiB", "3GB" or a byte count (KB/MB/GB decimal, KiB/MiB/GiB binary); change it there
            invalid value "lots" for setting pinned_budget from environment variable OFFLOAD_PINNED_BUDGET: expected a size such as "6GiB", "3GB" or a byte count (KB/MB/GB decimal, KiB/MiB/GiB binary); change it there
            invalid value "maybe" for setting prefetch from environment variable OFFLOAD_PREFETCH: expected true or false (the environment also takes 1/0, yes/no, on/off); change it there
            invalid value "0" for setting prefetch_depth from environment variable OFFLOAD_PREFETCH_DEPTH: expected a whole number from 1 to 64 (each is a group held on the device; 1 is usually best); change it there
            invalid value "two" for setting blocks_per_group from environment variable OFFLOAD_BLOCKS_PER_GROUP: expected a whole number, 1 or more; change it there
            invalid value " " for setting disk_store_dir from environment variable OFFLOAD_DISK_STORE_DIR: expected a path; change it there
            invalid value "2" for setting low_host_memory from environment variable OFFLOAD_LOW_HOST_MEMORY: expected true or false (the environment also takes 1/0, yes/no, on/off); change it there
            invalid value "yes please" for setting retry_on_oom from environment variable OFFLOAD_RETRY_ON_OOM: expected true or false (the environment also takes 1/0, yes/no, on/off); change it there
            invalid value "my workload/1" for setting profile_name from environment variable OFFLOAD_PROFILE_NAME: expected non-empty text of letters, digits, '-', '_' or '.'; change it there
            invalid value "" for setting profile_dir from environment variable OFFLOAD_PROFILE_DIR: expected a path; change it there
            invalid value "sometimes" for setting calibrate from environment variable OFFLOAD_CALIBRATE: expected true or false (the environment also takes 1/0, yes/no, on/off); change it there
            invalid value "-4" for setting full_pin_ratio from environment variable OFFLOAD_FULL_PIN_RATIO: expected a number, 0 or more (0 disables); change it there
            invalid value "16 GB RAM" for setting host_available from environment variable OFFLOAD_HOST_AVAILABLE: expected a size such as "6GiB", "3GB" or a byte count (KB/MB/GB decimal, KiB/MiB/GiB binary); change it there
            invalid value "disk" for setting host_tier from environment variable OFFLOAD_HOST_TIER: expected auto (the planner chooses from the host budget), ram or file; change it there
        "#]],
    );
}

#[test]
fn a_bad_value_in_the_file_is_refused_with_its_key() {
    let cases: &[(&str, &str)] = &[
        ("preset = 3", "preset"),
        ("reserve = -5", "reserve"),
        ("reserve = true", "reserve"),
        ("prefetch = \"true\"", "prefetch"),
        ("prefetch_depth = 0", "prefetch_depth"),
        ("blocks_per_group = 1.5", "blocks_per_group"),
        ("disk_store_dir = 5", "disk_store_dir"),
        ("profile_name = \"\"", "profile_name"),
        ("full_pin_ratio = -1.0", "full_pin_ratio"),
        ("full_pin_ratio = \"4\"", "full_pin_ratio"),
        ("host_available = [1]", "host_available"),
    ];
    for (file, key) in cases {
        let err = Settings::resolve(&SettingsLayer::default(), no_env(), Some(file)).expect_err(file);
        assert!(
            matches!(&err, PlanError::InvalidValue { key: named, origin: Origin::File, .. } if named == key),
            "{file}: {err:?}"
        );
    }
    let err = Settings::resolve(&SettingsLayer::default(), no_env(), Some("prefetch_depth = 0")).expect_err("zero");
    check(
        err.to_string(),
        expect![[
            r#"invalid value "0" for setting prefetch_depth from the TOML settings file: expected a whole number from 1 to 64 (each is a group held on the device; 1 is usually best); change it there"#
        ]],
    );
}

#[test]
fn an_unknown_key_or_variable_lists_the_accepted_ones() {
    let err = Settings::resolve(&SettingsLayer::default(), no_env(), Some("presets = \"auto\"")).expect_err("typo");
    assert!(matches!(&err, PlanError::UnknownKey { key, origin: Origin::File, .. } if key == "presets"));
    check(
        err.to_string(),
        expect![[
            r#"unknown setting "presets" in the TOML settings file; use one of: preset, reserve, resident_budget, pinned_budget, prefetch, prefetch_depth, blocks_per_group, disk_store_dir, low_host_memory, retry_on_oom, profile_name, profile_dir, calibrate, full_pin_ratio, host_available, host_tier"#
        ]],
    );

    let err =
        Settings::resolve(&SettingsLayer::default(), env(&[("OFFLOAD_PRESETS", "auto")]), None).expect_err("typo");
    assert!(matches!(&err, PlanError::UnknownVariable { name, .. } if name == "OFFLOAD_PRESETS"));
    check(
        err.to_string(),
        expect![
            "unknown environment variable OFFLOAD_PRESETS; unset it or use one of: OFFLOAD_PRESET, OFFLOAD_RESERVE, OFFLOAD_RESIDENT_BUDGET, OFFLOAD_PINNED_BUDGET, OFFLOAD_PREFETCH, OFFLOAD_PREFETCH_DEPTH, OFFLOAD_BLOCKS_PER_GROUP, OFFLOAD_DISK_STORE_DIR, OFFLOAD_LOW_HOST_MEMORY, OFFLOAD_RETRY_ON_OOM, OFFLOAD_PROFILE_NAME, OFFLOAD_PROFILE_DIR, OFFLOAD_CALIBRATE, OFFLOAD_FULL_PIN_RATIO, OFFLOAD_HOST_AVAILABLE, OFFLOAD_HOST_TIER, OFFLOAD_CONFIG"
        ],
    );

    let err = SettingsLayer::default().set("resident", "1GB").expect_err("typo");
    assert!(matches!(&err, PlanError::UnknownKey { origin: Origin::Explicit, .. }));

    // Tables are not settings either: the file is flat.
    let err = Settings::resolve(&SettingsLayer::default(), no_env(), Some("[transformer]\npreset = \"off\""))
        .expect_err("table");
    assert!(matches!(&err, PlanError::UnknownKey { key, .. } if key == "transformer"), "{err:?}");
}

#[test]
fn malformed_toml_is_a_typed_error() {
    let err = Settings::resolve(&SettingsLayer::default(), no_env(), Some("preset = ")).expect_err("syntax");
    assert!(matches!(err, PlanError::InvalidToml { .. }), "{err:?}");
    assert!(err.to_string().starts_with("cannot read the settings file:"), "{err}");
}

#[test]
fn values_set_directly_on_the_explicit_layer_are_checked() {
    for (layer, key) in [
        (SettingsLayer { prefetch_depth: Some(0), ..SettingsLayer::default() }, "prefetch_depth"),
        (SettingsLayer { blocks_per_group: Some(0), ..SettingsLayer::default() }, "blocks_per_group"),
        (SettingsLayer { full_pin_ratio: Some(f64::NAN), ..SettingsLayer::default() }, "full_pin_ratio"),
        (SettingsLayer { profile_name: Some("a b".into()), ..SettingsLayer::default() }, "profile_name"),
    ] {
        let err = Settings::resolve(&layer, no_env(), None).expect_err(key);
        assert!(
            matches!(&err, PlanError::InvalidValue { key: named, origin: Origin::Explicit, .. } if named == &key),
            "{err:?}"
        );
    }
}

#[test]
fn a_prefetch_depth_past_the_bound_is_refused_from_every_layer() {
    // The depth a user once passed: before the bound it reached the group offloader, whose window allocation
    // panicked with `capacity overflow` under its lock.
    let absurd = usize::MAX.to_string();
    let past = (MAX_PREFETCH_DEPTH + 1).to_string();
    for text in [absurd.as_str(), past.as_str()] {
        let explicit = SettingsLayer::default().set("prefetch_depth", text).expect_err(text);
        assert!(matches!(&explicit, PlanError::InvalidValue { key: "prefetch_depth", .. }), "{explicit:?}");
        let from_env = Settings::resolve(&SettingsLayer::default(), env(&[("OFFLOAD_PREFETCH_DEPTH", text)]), None)
            .expect_err(text);
        assert!(from_env.to_string().contains("from 1 to 64"), "{from_env}");
        let file = format!("prefetch_depth = {text}");
        assert!(Settings::resolve(&SettingsLayer::default(), no_env(), Some(&file)).is_err(), "{file}");
    }
    let direct = SettingsLayer { prefetch_depth: Some(usize::MAX), ..SettingsLayer::default() };
    assert!(Settings::resolve(&direct, no_env(), None).is_err());
    // The bound itself is accepted, and the message's number is the constant's.
    let top = SettingsLayer::default().set("prefetch_depth", &MAX_PREFETCH_DEPTH.to_string());
    assert!(top.is_ok(), "{top:?}");
    assert!(Kind::Depth.expected().contains(&format!("1 to {MAX_PREFETCH_DEPTH}")));
}

#[test]
fn environment_booleans_take_the_usual_spellings() {
    for (text, expected) in [
        ("1", true),
        ("TRUE", true),
        ("yes", true),
        ("on", true),
        ("0", false),
        ("False", false),
        ("no", false),
        ("off", false),
    ] {
        let settings =
            Settings::resolve(&SettingsLayer::default(), env(&[("OFFLOAD_PREFETCH", text)]), None).expect(text);
        assert_eq!(settings.prefetch, expected, "{text}");
    }
}

#[test]
fn the_documented_table_lists_every_key() {
    let table = settings_table();
    for info in KEYS {
        assert!(table.contains(&format!("`{}`", info.variable())), "{}", info.key);
    }
    let docs = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/presets.md"))
        .expect("docs/presets.md");
    assert!(
        docs.contains(&table),
        "docs/presets.md must contain the settings table exactly as settings_table() prints it:\n{table}"
    );
}
