//! Capacity profiles: the stable key, the TOML round trip, warnings past the validated range, and named
//! calibration feeding the planner on a simulated 8GB card.

mod plan_common;

use std::path::PathBuf;

use expect_test::expect;
use offload_core::plan::{
    CapacityProfile, MAX_OBSERVATIONS, Observation, Outcome, PlanError, Preset, ProfileStore, Settings, SettingsLayer,
    WarningKind, Workload, budget, plan_pipeline,
};
use plan_common::{machine, z_image_turbo};

/// A fresh directory under the system temp dir, unique to this process and test, removed when dropped.
struct Scratch(PathBuf);

impl Scratch {
    fn new(name: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("offload-plan-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        Self(dir)
    }

    fn store(&self) -> ProfileStore {
        ProfileStore::at(&self.0)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn workload() -> Workload {
    Workload::new().with("model", "z-image-turbo").with("card", "8GB").with("dtype", "bf16").with("preset", "auto")
}

#[test]
fn the_key_is_a_stable_hash_of_the_identity() {
    // Stable across runs, machines and releases: a changed key orphans every stored profile.
    expect!["8c0f615555e20fa2"].assert_eq(&workload().key());
    // Order of insertion does not matter; every value does.
    let reordered =
        Workload::new().with("preset", "auto").with("dtype", "bf16").with("card", "8GB").with("model", "z-image-turbo");
    assert_eq!(reordered.key(), workload().key());
    assert_ne!(workload().with("card", "12GB").key(), workload().key());
    // The encoding is length-prefixed, so moving a character between key and value changes the key.
    assert_ne!(Workload::new().with("ab", "c").key(), Workload::new().with("a", "bc").key());
    expect![[r#"
        offload-capacity-v1
        4:card3:8GB
        5:dtype4:bf16
        5:model13:z-image-turbo
        6:preset4:auto
    "#]]
    .assert_eq(&workload().canonical());
}

#[test]
fn a_profile_round_trips_through_toml() {
    let scratch = Scratch::new("round-trip");
    let store = scratch.store();
    store
        .record(
            &workload(),
            Observation::success(6_000_000_000, 20_000_000_000).with_metric("pixels", 1_048_576.0).at(100),
        )
        .expect("saved");
    store
        .record(
            &workload(),
            Observation::failure(7_300_000_000, 21_000_000_000).with_metric("pixels", 4_194_304.0).at(200),
        )
        .expect("saved");
    let loaded = store.load(&workload()).expect("readable").expect("present");
    assert_eq!(loaded.observations.len(), 2);
    assert_eq!(loaded.peaks.device, 6_000_000_000, "failures do not raise the validated peak");
    let limit = loaded.limits.get("pixels").copied().unwrap_or_default();
    assert_eq!((limit.max_success, limit.min_failure), (Some(1_048_576.0), Some(4_194_304.0)));
    assert_eq!(loaded.updated_at, 200);
    let text = std::fs::read_to_string(store.path(&workload())).expect("file");
    let reparsed: CapacityProfile = toml::from_str(&text).expect("valid TOML");
    assert_eq!(reparsed, loaded);
    expect![[r#"
        schema_version = 1
        key = "8c0f615555e20fa2"
        updated_at = 200

        [workload]
        card = "8GB"
        dtype = "bf16"
        model = "z-image-turbo"
        preset = "auto"

        [peaks]
        device = 6000000000
        host = 20000000000

        [limits.pixels]
        max_success = 1048576.0
        min_failure = 4194304.0

        [[observations]]
        at = 100
        outcome = "success"
        peak_device = 6000000000
        peak_host = 20000000000

        [observations.metrics]
        pixels = 1048576.0

        [[observations]]
        at = 200
        outcome = "failure"
        peak_device = 7300000000
        peak_host = 21000000000

        [observations.metrics]
        pixels = 4194304.0
    "#]]
    .assert_eq(&text);
    assert!(store.path(&workload()).starts_with(store.dir()));
    assert!(store.path(&workload()).to_string_lossy().ends_with(&format!("{}.toml", workload().key())));
}

#[test]
fn a_run_past_the_validated_range_is_warned_about() {
    let scratch = Scratch::new("warnings");
    let store = scratch.store();
    // No profile yet: nothing to compare with.
    assert_eq!(store.check(&workload(), &[("pixels", 1e9)]).expect("readable"), vec![]);
    let first = store
        .record(&workload(), Observation::success(6 << 30, 20 << 30).with_metric("pixels", 1_048_576.0).at(1))
        .expect("saved");
    assert!(first.warnings.is_empty());

    // Within the range: quiet.
    assert!(store.check(&workload(), &[("pixels", 1_048_576.0)]).expect("readable").is_empty());
    // Past the largest success.
    let warnings = store.check(&workload(), &[("pixels", 2_097_152.0)]).expect("readable");
    assert!(matches!(warnings[0].kind, WarningKind::BeyondValidated { max_success } if max_success == 1_048_576.0));
    expect!["pixels = 2097152 exceeds the largest validated pixels (1048576) of capacity profile 8c0f615555e20fa2; it may run out of memory: lower it or use a preset with less resident memory"]
        .assert_eq(&warnings[0].to_string());
    // A metric never validated.
    let warnings = store.check(&workload(), &[("frames", 16.0)]).expect("readable");
    assert!(matches!(warnings[0].kind, WarningKind::Unvalidated));

    // The run itself returns its warning in its result, and extends the range when it succeeds.
    let run = store
        .record(&workload(), Observation::success(7 << 30, 21 << 30).with_metric("pixels", 2_097_152.0).at(2))
        .expect("saved");
    assert_eq!(run.warnings.len(), 1);
    assert_eq!(run.profile.limits.get("pixels").and_then(|l| l.max_success), Some(2_097_152.0));
    assert!(store.check(&workload(), &[("pixels", 2_097_152.0)]).expect("readable").is_empty());

    // A failure at some size makes that size and above a stronger warning.
    store
        .record(&workload(), Observation::failure(7 << 30, 21 << 30).with_metric("pixels", 4_194_304.0).at(3))
        .expect("saved");
    let warnings = store.check(&workload(), &[("pixels", 8_388_608.0)]).expect("readable");
    assert!(matches!(warnings[0].kind, WarningKind::AtFailure { min_failure } if min_failure == 4_194_304.0));
    assert!(warnings[0].to_string().contains("failed before"), "{}", warnings[0]);
}

#[test]
fn only_the_last_observations_are_kept() {
    let scratch = Scratch::new("trim");
    let store = scratch.store();
    for i in 0..(MAX_OBSERVATIONS as u64 + 5) {
        store.record(&workload(), Observation::success(i, i).with_metric("steps", i as f64).at(i)).expect("saved");
    }
    let profile = store.load(&workload()).expect("readable").expect("present");
    assert_eq!(profile.observations.len(), MAX_OBSERVATIONS);
    assert_eq!(profile.observations.first().map(|o| o.at), Some(5));
    assert_eq!(
        profile.observations.last().map(|o| (o.at, o.outcome)),
        Some((MAX_OBSERVATIONS as u64 + 4, Outcome::Success))
    );
}

#[test]
fn stale_files_are_ignored_and_broken_ones_are_errors() {
    let scratch = Scratch::new("stale");
    let store = scratch.store();
    std::fs::create_dir_all(store.dir()).expect("dir");
    let mut old = CapacityProfile::new(&workload());
    old.schema_version = 0;
    std::fs::write(store.path(&workload()), toml::to_string(&old).expect("serialises")).expect("written");
    assert_eq!(store.load(&workload()).expect("ignored, not an error"), None);

    std::fs::write(store.path(&workload()), "schema_version = ").expect("written");
    let err = store.load(&workload()).expect_err("malformed");
    assert!(matches!(err, PlanError::ProfileFormat { .. }), "{err:?}");
    assert!(err.to_string().contains("delete it to start the profile over"), "{err}");
}

#[test]
fn the_default_directory_is_under_the_platform_data_dir() {
    if let Ok(dir) = ProfileStore::default_dir() {
        assert!(dir.ends_with("offload/profiles"), "{}", dir.display());
    }
    let settings = Settings::resolve(
        &SettingsLayer::default(),
        [("OFFLOAD_PROFILE_DIR".to_string(), "/tmp/elsewhere".to_string())],
        None,
    )
    .expect("valid");
    assert_eq!(ProfileStore::from_settings(&settings).expect("set").dir(), std::path::Path::new("/tmp/elsewhere"));
}

#[test]
fn calibration_on_a_simulated_card_records_the_peak_and_later_runs_reuse_its_budget() {
    let scratch = Scratch::new("calibration");
    let store = scratch.store();
    let card = machine(8, 32);
    let named = |extra: &[(&str, &str)]| -> Settings {
        let mut explicit = SettingsLayer { preset: Some(Preset::Auto), ..SettingsLayer::default() };
        explicit.set("profile_name", "zimage-1024").expect("valid");
        for (k, v) in extra {
            explicit.set(k, v).expect("valid");
        }
        let mut settings = Settings::resolve(&explicit, std::iter::empty::<(String, String)>(), None).expect("valid");
        store.apply_calibration(&mut settings).expect("readable");
        settings
    };

    // First run: nothing stored, so a calibration run with nothing resident.
    let settings = named(&[]);
    assert_eq!(settings.calibration, None);
    let first = plan_pipeline(&z_image_turbo(), settings, &card).expect("plans");
    let transformer = first.component("transformer").expect("planned");
    assert_eq!(transformer.resident_bytes, 23_704_704, "only the bytes outside the blocks: {}", transformer.why);
    assert!(transformer.why.contains("calibration run of profile zimage-1024"), "{}", transformer.why);

    // The simulated card measures the denoise phase's peak; here the plan's own prediction stands in, plus
    // 300 MB the estimate missed.
    let measured_peak = transformer.peak_bytes + 300_000_000;
    let recommendation = store
        .record_calibration("zimage-1024", card.device_available, measured_peak, transformer.resident_bytes)
        .expect("saved");
    assert_eq!(
        recommendation.resident_budget,
        budget::recommend_resident_budget(card.device_available, measured_peak, transformer.resident_bytes)
    );

    // Later runs reuse it.
    let settings = named(&[]);
    assert_eq!(settings.calibration, Some(recommendation));
    let later = plan_pipeline(&z_image_turbo(), settings, &card).expect("plans");
    let transformer = later.component("transformer").expect("planned");
    assert!(transformer.why.contains("profile zimage-1024 recommends"), "{}", transformer.why);
    assert!(
        transformer.resident_bytes > 23_704_704
            && transformer.resident_bytes <= recommendation.resident_budget + 23_704_704
    );
    assert!(
        transformer.peak_bytes + 300_000_000 <= card.device_available,
        "the measured overshoot still fits: {}",
        transformer.why
    );
    // Components called once per image are not given the denoiser's budget.
    assert_eq!(
        later.component("text_encoder").map(|c| c.resident_bytes),
        first.component("text_encoder").map(|c| c.resident_bytes)
    );

    // An explicit resident budget beats the recommendation; calibrate=true measures again.
    let explicit = plan_pipeline(&z_image_turbo(), named(&[("resident_budget", "1GiB")]), &card).expect("plans");
    assert!(
        explicit
            .component("transformer")
            .is_some_and(|c| c.why.contains("resident_budget 1.00 GB from an explicit argument"))
    );
    let again = named(&[("calibrate", "true")]);
    assert_eq!(again.calibration, None);
    let again = plan_pipeline(&z_image_turbo(), again, &card).expect("plans");
    assert!(again.component("transformer").is_some_and(|c| c.why.contains("calibration run")));
}

/// The link a run measured is kept per device beside the capacity profiles, and the next plan for that device
/// predicts its copies from it instead of the generic PCIe assumption, and says so.
#[test]
fn a_measured_link_is_stored_per_device_and_replaces_the_assumed_one() {
    use offload_core::plan::{LinkRun, LinkSource, MAX_LINK_RUNS};
    let scratch = Scratch::new("link");
    let store = scratch.store();
    assert_eq!(store.measured_link("wgpu:0").expect("readable"), None, "nothing measured yet");
    // lavapipe-like: 20 MB/s from pageable memory (it has no page-locked memory), three runs.
    let run =
        |rate: f64| LinkRun { pageable: Some(rate), page_locked: None, p10: rate / 2.0, uploads: 25, bytes: 1, at: 0 };
    for rate in [18e6, 20e6, 40e6] {
        store.record_link("wgpu:0", run(rate)).expect("saved");
    }
    let measured = store.measured_link("wgpu:0").expect("readable").expect("three runs");
    assert_eq!((measured.pageable, measured.page_locked, measured.runs, measured.uploads), (Some(20e6), None, 3, 75));
    assert_eq!(store.measured_link("cuda:0").expect("readable"), None, "one device's runs are not another's");

    let assumed = machine(8, 32);
    let learned = assumed.clone().with_time(measured.apply(assumed.time));
    assert_eq!(learned.time.link_source, LinkSource::Measured { runs: 3, uploads: 75 });
    assert_eq!((learned.time.link_bytes_per_second, learned.time.pageable_fraction), (20e6, 1.0));
    let before = plan_pipeline(&z_image_turbo(), Preset::Auto, &assumed).expect("plans");
    let after = plan_pipeline(&z_image_turbo(), Preset::Auto, &learned).expect("plans");
    assert!(before.to_string().contains("(assumed, not measured"), "{before}");
    assert!(
        after.to_string().contains("link: 20.00 MB/s from pinned memory, 20.00 MB/s pageable (measured"),
        "{after}"
    );
    // Copies at 20 MB/s, not 15.75 GB/s: what streams takes about 790 times longer to predict.
    assert!(after.seconds_per_image() > 100.0 * before.seconds_per_image(), "{before}\n{after}");

    // Only the last runs are kept.
    for _ in 0..MAX_LINK_RUNS {
        store.record_link("wgpu:0", run(1e9)).expect("saved");
    }
    let newest = store.measured_link("wgpu:0").expect("readable").expect("runs");
    assert_eq!((newest.runs, newest.pageable), (MAX_LINK_RUNS, Some(1e9)));

    // A broken file is an error that names it, not an empty link.
    std::fs::write(store.link_path("wgpu:0"), "runs = 3").expect("written");
    match store.measured_link("wgpu:0") {
        Err(PlanError::ProfileFormat { path, .. }) => assert_eq!(path, store.link_path("wgpu:0")),
        other => panic!("expected a format error, got {other:?}"),
    }
}

/// The disk rate a run measured reading host copies from their files is kept per disk beside the capacity
/// profiles, and the next plan predicts its reads from it instead of the assumed 2 GB/s, and says so.
#[test]
fn a_measured_disk_rate_is_stored_per_disk_and_replaces_the_assumed_one() {
    use offload_core::plan::{DiskRun, LinkSource, MAX_DISK_RUNS, MeasuredDisk};
    let scratch = Scratch::new("disk");
    let store = scratch.store();
    let disk = "/models/z-image-turbo";
    assert_eq!(store.measured_disk(disk).expect("readable"), None, "nothing measured yet");
    let run = |rate: f64| DiskRun { median: rate, p10: rate / 2.0, reads: 34, bytes: 12_309_817_472, at: 0 };
    for rate in [0.4e9, 0.5e9, 3e9] {
        store.record_disk(disk, run(rate)).expect("saved");
    }
    let measured = store.measured_disk(disk).expect("readable").expect("three runs");
    assert_eq!((measured.median, measured.p10, measured.runs, measured.reads), (0.5e9, 0.25e9, 3, 102));
    assert_eq!(measured.to_string(), "reads at 0.50 GB/s, 10th percentile 0.25 GB/s (median of 3 runs, 102 reads)");
    assert_eq!(store.measured_disk("/other").expect("readable"), None, "one disk's runs are not another's");
    // The link's figures are another file: they stay unmeasured.
    assert_eq!(store.measured_link(disk).expect("readable"), None);

    let facts = offload_core::plan::DeviceFacts::new(
        memory_sim::SimCard::new(memory_sim::CardSpec::parse("8GB").expect("a card")),
        offload_core::plan::HostMemory::new(16_000_000_000, 14_400_000_000),
    );
    let learned = facts.with_measured_disk(Some(measured));
    assert_eq!(learned.time.disk_bytes_per_second, 0.5e9);
    assert_eq!(learned.time.disk_source, LinkSource::Measured { runs: 3, uploads: 102 });
    let assumed = machine(8, 64);
    let learned = assumed.clone().with_time(measured.apply(assumed.time));
    let before = plan_pipeline(&z_image_turbo(), Preset::LowRamSafe, &assumed).expect("plans");
    let after = plan_pipeline(&z_image_turbo(), Preset::LowRamSafe, &learned).expect("plans");
    assert!(before.to_string().contains("disk: 2.00 GB/s read (assumed, not measured"), "{before}");
    assert!(
        after.to_string().contains("disk: 0.50 GB/s read (measured: the median of 3 runs' medians, 102 reads)"),
        "{after}"
    );
    assert!(after.seconds_per_image() > 2.0 * before.seconds_per_image(), "{before}\n{after}");

    // Only the last runs are kept; a run that timed nothing is refused and changes nothing.
    for _ in 0..MAX_DISK_RUNS {
        store.record_disk(disk, run(1e9)).expect("saved");
    }
    let newest = store.measured_disk(disk).expect("readable").expect("runs");
    assert_eq!((newest.runs, newest.median), (MAX_DISK_RUNS, 1e9));
    let err = store.record_disk(disk, DiskRun { reads: 0, ..run(1e9) }).expect_err("nothing timed");
    expect![[r#"cannot store the disk run of /models/z-image-turbo: it timed 0 reads at a median of 1000000000 bytes/s; store only runs that timed reads (DiskRun::from_rate gives None for a run that timed none)"#]]
    .assert_eq(&err.to_string());
    assert_eq!(store.measured_disk(disk).expect("readable"), Some(newest));
    assert_eq!(MeasuredDisk::from_runs(&[]), None);

    // A broken file is an error that names it, not an assumed rate.
    std::fs::write(store.disk_path(disk), "runs = 3").expect("written");
    match store.measured_disk(disk) {
        Err(PlanError::ProfileFormat { path, .. }) => assert_eq!(path, store.disk_path(disk)),
        other => panic!("expected a format error, got {other:?}"),
    }
}

/// The rate of a peer's copies onto the execution device, measured by a run's peer meter, is kept per pair beside
/// the capacity profiles; the next plan prices the peer's bytes at it instead of the declared rate, and says so. A
/// card declared to be over NVLink that measured at PCIe 3.0 x8's rate then holds nothing: pageable RAM is faster.
#[test]
fn a_measured_peer_rate_is_stored_per_pair_and_replaces_the_declared_one() {
    use offload_core::plan::{LinkSource, MAX_PEER_RUNS, MeasuredPeer, PeerDevice, PeerRun};
    let scratch = Scratch::new("peer");
    let store = scratch.store();
    assert_eq!(store.measured_peer("cuda:0", "cuda:1").expect("readable"), None, "nothing measured yet");
    let run = |rate: f64| PeerRun { median: rate, p10: rate / 2.0, copies: 13, bytes: 4_381_000_000, at: 0 };
    for rate in [2.8e9, 3.1e9, 45e9] {
        store.record_peer("cuda:0", "cuda:1", run(rate)).expect("saved");
    }
    let measured = store.measured_peer("cuda:0", "cuda:1").expect("readable").expect("three runs");
    assert_eq!((measured.median, measured.p10, measured.runs, measured.copies), (3.1e9, 1.55e9, 3, 39));
    assert_eq!(measured.to_string(), "copies at 3.10 GB/s, 10th percentile 1.55 GB/s (median of 3 runs, 39 copies)");
    // One pair's runs are not another's, nor the other direction's, nor the host link's.
    assert_eq!(store.measured_peer("cuda:0", "cuda:2").expect("readable"), None);
    assert_eq!(store.measured_peer("cuda:1", "cuda:0").expect("readable"), None);
    assert_eq!(store.measured_link("cuda:0").expect("readable"), None);

    let declared = PeerDevice::new("cuda:1", 4_000_000_000, 50e9, 10e-6);
    let before =
        plan_pipeline(&z_image_turbo(), Preset::Auto, &machine(8, 32).with_peer(declared.clone())).expect("plans");
    let learned = machine(8, 32).with_peer(declared.with_measured(Some(measured)));
    assert_eq!(learned.peers[0].source, LinkSource::Measured { runs: 3, uploads: 39 });
    let after = plan_pipeline(&z_image_turbo(), Preset::Auto, &learned).expect("plans");
    let transformer = |plan: &offload_core::plan::Plan| plan.component("transformer").expect("planned").clone();
    assert!(transformer(&before).peer_bytes("cuda:1") > 3_000_000_000, "{before}");
    assert!(after.components.iter().all(|c| c.peer_bytes("cuda:1") == 0), "{after}");
    assert!(
        transformer(&after).why.contains(
            "no streamed group is held on cuda:1: the host's copies cost less, or the peers are full (0.323 s per GB \
             (measured: the median of 3 runs' medians, 39 copies) from cuda:1 against"
        ),
        "{}",
        transformer(&after).why
    );
    assert!(after.seconds_per_image() > before.seconds_per_image(), "{before}\n{after}");

    // Only the last runs are kept; a run that timed nothing is refused and changes nothing.
    for _ in 0..MAX_PEER_RUNS {
        store.record_peer("cuda:0", "cuda:1", run(40e9)).expect("saved");
    }
    let newest = store.measured_peer("cuda:0", "cuda:1").expect("readable").expect("runs");
    assert_eq!((newest.runs, newest.median), (MAX_PEER_RUNS, 40e9));
    let err = store.record_peer("cuda:0", "cuda:1", PeerRun { copies: 0, ..run(1e9) }).expect_err("nothing timed");
    expect!["cannot store the run of the copies from cuda:1 onto cuda:0: it timed 0 copies at a median of 1000000000 bytes/s; store only runs that timed copies (PeerRun::from_rate gives None for a run that timed none)"].assert_eq(&err.to_string());
    assert_eq!(store.measured_peer("cuda:0", "cuda:1").expect("readable"), Some(newest));
    assert_eq!(MeasuredPeer::from_runs(&[]), None);

    // A broken file is an error that names it, not a declared rate.
    std::fs::write(store.peer_path("cuda:0", "cuda:1"), "runs = 3").expect("written");
    match store.measured_peer("cuda:0", "cuda:1") {
        Err(PlanError::ProfileFormat { path, .. }) => assert_eq!(path, store.peer_path("cuda:0", "cuda:1")),
        other => panic!("expected a format error, got {other:?}"),
    }
}

/// A component's footprint measured in a device's pages is kept per device beside the capacity profiles, and the
/// next plan counts what stays on the device in those bytes (its peak, whether everything fits), while what
/// crosses the link stays the weight bytes.
#[test]
fn a_measured_footprint_is_stored_per_device_and_the_plan_counts_the_device_in_it() {
    use offload_core::plan::{ComponentSpec, Footprint, HostMemory, Machine, Route, apply_footprints};
    let scratch = Scratch::new("footprint");
    let store = scratch.store();
    assert_eq!(store.footprints("wgpu:0").expect("readable"), Vec::new(), "nothing measured yet");
    let vae = |device_bytes| Footprint { component: "vae".into(), weight_bytes: 1_000_000, device_bytes };
    store.record_footprints("wgpu:0", &[vae(1_600_000)]).expect("saved");
    // A later measurement of the same component and size replaces the earlier one; another size is kept apart.
    let other = Footprint { component: "vae".into(), weight_bytes: 2_000_000, device_bytes: 2_100_000 };
    let stored = store.record_footprints("wgpu:0", &[vae(1_500_000), other.clone()]).expect("saved");
    assert_eq!(stored, [vae(1_500_000), other]);
    assert_eq!(store.footprints("wgpu:0").expect("readable"), stored);
    assert_eq!(store.footprints("cuda:0").expect("readable"), Vec::new(), "one device's are not another's");

    // 1.0 MB of weights that take 1.5 MB of pages, beside 0.5 MB of activations, on 1.8 MB: they fit in bytes,
    // not in pages.
    let spec = ComponentSpec::new("vae", 1_000_000).with_activation(500_000);
    let small = Machine::new(1_800_000, 1_800_000, HostMemory::new(1 << 40, 1 << 40));
    let settings = Settings::resolve(
        &SettingsLayer { preset: Some(Preset::Auto), reserve: Some(500_000), ..SettingsLayer::default() },
        std::iter::empty::<(String, String)>(),
        None,
    )
    .expect("settings");
    let counted_in_bytes = plan_pipeline(std::slice::from_ref(&spec), settings.clone(), &small).expect("plans");
    assert_eq!(counted_in_bytes.components[0].route, Route::Resident);
    assert_eq!(counted_in_bytes.peak_bytes(), 1_500_000);
    let mut specs = [spec];
    assert_eq!(apply_footprints(&mut specs, &store.footprints("wgpu:0").expect("readable")), 1);
    assert_eq!(specs[0].device_bytes, Some(1_500_000));
    match plan_pipeline(&specs, settings, &small) {
        Err(PlanError::DoesNotFit { component, needs, .. }) => {
            assert_eq!((component.as_str(), needs), ("vae", 2_000_000))
        }
        other => panic!("1.5 MB of pages and 0.5 MB of activations do not fit in 1.8 MB: {other:?}"),
    }

    // Streamed, the window and the resident part are in pages, the bytes moved are the weights'.
    let transformer = z_image_turbo().into_iter().find(|s| s.name == "transformer").expect("a transformer");
    let weights = transformer.weight_bytes;
    let paged = transformer.clone().with_device_bytes(weights / 10 * 11);
    let card = machine(8, 64);
    let plain =
        plan_pipeline(std::slice::from_ref(&transformer), Preset::DiffusersOffloadCompat, &card).expect("plans");
    let paged_plan = plan_pipeline(std::slice::from_ref(&paged), Preset::DiffusersOffloadCompat, &card).expect("plans");
    let (plain, paged_plan) = (&plain.components[0], &paged_plan.components[0]);
    assert!(plain.route.is_group_offload() && paged_plan.route == plain.route, "{plain:?}\n{paged_plan:?}");
    assert_eq!(paged_plan.streamed_per_image, plain.streamed_per_image, "the link moves the weight bytes");
    let activation = transformer.activation_bytes;
    let on_device = |plan: &offload_core::plan::ComponentPlan| plan.peak_bytes - activation;
    let grown = on_device(paged_plan) as f64 / on_device(plain) as f64;
    assert!((grown - 1.1).abs() < 1e-3, "the weights on the device grow by the pages' 10%: {grown}");
}

/// A call's measured pages are kept per device in the same file as the weights' footprints, each component and
/// estimate apart, and the next plan counts a call as the larger of its estimate and its pages: in the peak and in
/// the headroom that decides whether everything fits; a call that took less than its estimate keeps the estimate.
#[test]
fn a_measured_call_footprint_is_stored_per_device_and_the_plan_counts_a_call_as_the_larger_of_it_and_the_estimate() {
    use offload_core::plan::{
        CallFootprint, ComponentSpec, Footprint, HostMemory, Machine, Route, apply_call_footprints,
    };
    let scratch = Scratch::new("call-footprint");
    let store = scratch.store();
    assert_eq!(store.call_footprints("wgpu:0").expect("readable"), Vec::new(), "nothing measured yet");
    let call =
        |estimate_bytes, device_bytes| CallFootprint { component: "text_encoder".into(), estimate_bytes, device_bytes };
    let weights = Footprint { component: "text_encoder".into(), weight_bytes: 1_000_000, device_bytes: 1_040_000 };
    store.record_footprints("wgpu:0", std::slice::from_ref(&weights)).expect("saved");
    store.record_call_footprints("wgpu:0", &[call(32_000, 110_000)]).expect("saved");
    // A later measurement at the same estimate replaces the earlier one; another estimate is kept apart.
    let stored = store.record_call_footprints("wgpu:0", &[call(32_000, 87_000), call(64_000, 90_000)]).expect("saved");
    assert_eq!(stored, [call(32_000, 87_000), call(64_000, 90_000)]);
    assert_eq!(store.call_footprints("wgpu:0").expect("readable"), stored);
    assert_eq!(store.footprints("wgpu:0").expect("readable"), [weights], "the weights' footprints are kept beside");
    assert_eq!(store.call_footprints("cuda:0").expect("readable"), Vec::new(), "one device's are not another's");

    // 1 GiB of weights and a call estimated at 100 MiB fit resident on 1,500 MiB with the call's margin (256 MiB
    // at the least); a call that took 400 MiB of pages does not.
    const MIB: u64 = 1 << 20;
    let spec = ComponentSpec::new("text_encoder", 1024 * MIB).with_activation(100 * MIB);
    let small = Machine::new(1500 * MIB, 1500 * MIB, HostMemory::new(1 << 40, 1 << 40));
    let settings = Settings::resolve(
        &SettingsLayer { preset: Some(Preset::Auto), ..SettingsLayer::default() },
        std::iter::empty::<(String, String)>(),
        None,
    )
    .expect("settings");
    let estimated = plan_pipeline(std::slice::from_ref(&spec), settings.clone(), &small).expect("plans");
    assert_eq!(estimated.components[0].route, Route::Resident);
    assert_eq!(estimated.peak_bytes(), 1124 * MIB);
    let large = |estimate_bytes, device_bytes| CallFootprint { estimate_bytes, device_bytes, ..call(0, 0) };
    let mut specs = [spec.clone()];
    assert_eq!(apply_call_footprints(&mut specs, &[large(100 * MIB, 400 * MIB), large(MIB, 2 * MIB)]), 1);
    assert_eq!((specs[0].call_device_bytes, specs[0].call_on_device()), (Some(400 * MIB), 400 * MIB));
    let measured = plan_pipeline(&specs, settings.clone(), &small);
    assert!(
        !matches!(&measured, Ok(plan) if plan.components[0].route == Route::Resident),
        "1 GiB and a call of 400 MiB of pages with its margin do not stay resident on 1,500 MiB: {measured:?}"
    );
    let roomy = Machine::new(4096 * MIB, 4096 * MIB, HostMemory::new(1 << 40, 1 << 40));
    let plan = plan_pipeline(&specs, settings.clone(), &roomy).expect("plans");
    assert_eq!(plan.peak_bytes(), 1424 * MIB, "the call counts as its pages");
    // A call that took less than its estimate keeps the estimate: the estimate models the tensors.
    let mut below = [spec.with_activation(200 * MIB)];
    assert_eq!(apply_call_footprints(&mut below, &[large(200 * MIB, 150 * MIB)]), 1);
    assert_eq!(below[0].call_on_device(), 200 * MIB);
    assert_eq!(plan_pipeline(&below, settings, &roomy).expect("plans").peak_bytes(), 1224 * MIB);
}
