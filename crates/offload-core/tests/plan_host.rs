//! Host tiers: where each component's host copy lives (RAM, its checkpoint file, the disk store), chosen from the
//! host budget with the reason, and the typed error when the host cannot hold what must stay in RAM.

mod plan_common;

use expect_test::{Expect, expect};
use offload_core::format_size;
use offload_core::plan::{
    ComponentSpec, HostMemory, HostTier, Machine, Plan, PlanError, Preset, Route, Settings, SettingsLayer, TimeModel,
    enable_offload, plan_pipeline,
};
use plan_common::{machine, z_image_turbo};

fn check(actual: String, expect: Expect) {
    expect.assert_eq(&actual);
}

fn settings(preset: Preset, set: &[(&str, &str)]) -> Settings {
    let mut explicit = SettingsLayer { preset: Some(preset), ..SettingsLayer::default() };
    for (key, value) in set {
        explicit.set(key, value).expect("the test's settings are valid");
    }
    Settings::resolve(&explicit, std::iter::empty::<(String, String)>(), None).expect("the test's settings are valid")
}

/// Z-Image-Turbo as a pipeline whose weights changed after loading (quantized or LoRA-fused): no file serves them.
fn in_ram_only() -> Vec<ComponentSpec> {
    z_image_turbo().into_iter().map(|c| c.with_file_backed(false)).collect()
}

/// Each component's tier, host RAM bytes and bytes in its tier, one line each.
fn tiers(plan: &Plan) -> String {
    let mut out = String::new();
    for c in &plan.components {
        out.push_str(&format!(
            "{}: {} ({} in RAM, {} in its tier)\n",
            c.component,
            c.host_tier,
            format_size(c.host_bytes),
            format_size(c.host_copy_bytes)
        ));
    }
    out
}

#[test]
fn host_copies_stay_in_ram_where_they_fit() {
    let plan = plan_pipeline(&z_image_turbo(), Preset::Auto, &machine(8, 32)).expect("plans");
    check(
        tiers(&plan),
        expect![[r#"
            text_encoder: ram (7.49 GB in RAM, 7.49 GB in its tier)
            transformer: ram (11.46 GB in RAM, 11.46 GB in its tier)
            vae: ram (159.87 MB in RAM, 159.87 MB in its tier)
        "#]],
    );
    let transformer = plan.component("transformer").expect("planned");
    assert!(transformer.why.contains("its host copy stays in RAM (11.46 GB)"), "{}", transformer.why);
    assert!(plan.warnings.is_empty(), "{plan}");
}

#[test]
fn a_resident_component_is_loaded_from_its_file_and_keeps_no_host_copy() {
    // Everything fits on a 40 GB card: resident components read their files once, straight to the device.
    let plan = plan_pipeline(&z_image_turbo(), Preset::Auto, &machine(40, 64)).expect("plans");
    assert!(plan.components.iter().all(|c| c.route == Route::Resident), "{plan}");
    assert!(plan.components.iter().all(|c| c.host_tier == HostTier::File && c.host_bytes == 0), "{plan}");
    assert_eq!(plan.host_bytes(), 0);
    let vae = plan.component("vae").expect("planned");
    assert!(vae.why.contains("loaded from its checkpoint file straight to the device"), "{}", vae.why);

    // Weights changed after loading are loaded into RAM first, and the mechanism keeps that copy: it is counted.
    let plan = plan_pipeline(&in_ram_only(), Preset::Auto, &machine(40, 64)).expect("plans");
    check(
        tiers(&plan),
        expect![[r#"
            text_encoder: ram (7.49 GB in RAM, 7.49 GB in its tier)
            transformer: ram (11.46 GB in RAM, 11.46 GB in its tier)
            vae: ram (159.87 MB in RAM, 159.87 MB in its tier)
        "#]],
    );
}

#[test]
fn file_backed_copies_leave_ram_for_their_files_when_the_copies_do_not_fit() {
    // 16 GB of RAM: 11.41 GB usable for 19.11 GB of copies. The transformer must leave RAM (the others together
    // are 7.65 GB, so freeing them alone cannot make room); the text encoder leaves too, because then the RAM
    // left holds the transformer's 6.07 GB of streamed groups, placed there by cost.
    let plan = plan_pipeline(&z_image_turbo(), Preset::Auto, &machine(8, 16)).expect("plans instead of warning");
    check(
        tiers(&plan),
        expect![[r#"
            text_encoder: file (5.18 GB in RAM, 7.49 GB in its tier)
            transformer: file (6.07 GB in RAM, 11.46 GB in its tier)
            vae: ram (159.87 MB in RAM, 159.87 MB in its tier)
        "#]],
    );
    assert!(plan.host_bytes() <= plan.usable_host, "{plan}");
    assert!(plan.warnings.is_empty(), "{plan}");
    assert_eq!(plan.pinned_bytes(), 0, "a file's pages are not pinned");
    let transformer = plan.component("transformer").expect("planned");
    assert!(!transformer.on_disk, "on_disk is the disk store only");
    assert!(transformer.why.contains("its host copy is the checkpoint file"), "{}", transformer.why);
    assert!(transformer.why.contains("at 2.00 GB/s (assumed"), "{}", transformer.why);
    // The RAM the other copies leave holds its streamed groups after their first read (a split): its first step
    // reads only the resident groups from the file, and no later step reads the file.
    assert_eq!(transformer.ram_streamed_bytes, transformer.host_bytes, "{}", transformer.why);
    assert!(
        transformer.why.contains("18 of its 18 streamed groups (6.07 GB) keep their host copy in RAM"),
        "{}",
        transformer.why
    );
    assert!(transformer.why.contains("each later step its 6.07 GB from RAM"), "{}", transformer.why);

    // With more RAM only the copy that is cheapest to read from its file leaves: the text encoder, read once per
    // image, rather than the larger transformer, read at every step.
    let plan = plan_pipeline(&z_image_turbo(), Preset::Auto, &machine(8, 24)).expect("plans");
    check(
        tiers(&plan),
        expect![[r#"
            text_encoder: file (5.69 GB in RAM, 7.49 GB in its tier)
            transformer: ram (11.46 GB in RAM, 11.46 GB in its tier)
            vae: ram (159.87 MB in RAM, 159.87 MB in its tier)
        "#]],
    );
    let text_encoder = plan.component("text_encoder").expect("planned");
    assert!(text_encoder.why.contains("costs the least predicted time"), "{}", text_encoder.why);
}

#[test]
fn a_copy_that_differs_from_its_file_goes_to_the_disk_store() {
    let plan = plan_pipeline(
        &in_ram_only(),
        settings(Preset::Auto, &[("disk_store_dir", "/tmp/offload-store")]),
        &machine(12, 16),
    )
    .expect("plans");
    assert!(plan.host_bytes() <= plan.usable_host, "{plan}");
    assert!(plan.warnings.is_empty(), "{plan}");
    let transformer = plan.component("transformer").expect("planned");
    assert_eq!(transformer.host_tier, HostTier::DiskStore, "{}", transformer.why);
    // Its streamed groups keep a copy in RAM after their first read (a split): the only RAM it takes.
    assert!(transformer.on_disk && transformer.host_bytes == transformer.ram_streamed_bytes, "{}", transformer.why);
    assert!(transformer.why.contains("keep their host copy in RAM after their first read"), "{}", transformer.why);
    assert!(
        transformer.why.contains("its host copy is in the disk store under /tmp/offload-store"),
        "{}",
        transformer.why
    );
    // A component that moves whole is not served by the disk store: the VAE stays in RAM.
    assert_eq!(plan.component("vae").map(|c| c.host_tier), Some(HostTier::Ram));
}

#[test]
fn a_host_that_cannot_hold_the_copies_is_a_typed_error_naming_what_would_fit() {
    // Copies that no file serves, no disk store, 16 GB of RAM: the run would swap, so there is no plan.
    let err = plan_pipeline(&in_ram_only(), Preset::Auto, &machine(8, 16)).expect_err("19.11 GB in 11.41 GB");
    assert!(matches!(err, PlanError::HostDoesNotFit { .. }), "{err:?}");
    check(
        err.to_string(),
        expect![[
            "cannot plan the host copies: text_encoder 7.49 GB (streams; not file-backed, no disk_store_dir), transformer 11.46 GB (streams; not file-backed, no disk_store_dir), vae 159.87 MB (moves whole; not file-backed) must stay in RAM and need 19.11 GB, 11.41 GB of host RAM usable (13.41 GB available less the 2.00 GB margin); set disk_store_dir to keep the streamed copies of text_encoder and transformer on disk (159.87 MB would stay in RAM), or load weights as they are in their files (not quantized or LoRA-fused after loading) so the files serve them, or free 7.70 GB of host RAM"
        ]],
    );

    // A component with no blocks moves whole, which no disk store serves: only RAM would fit it.
    let whole = ComponentSpec::new("unet", 5_000_000_000).with_activation(1 << 30);
    let small = Machine::new(8_000_000_000, 7_000_000_000, HostMemory::new(8_000_000_000, 6_000_000_000));
    let err = enable_offload(&whole, settings(Preset::Auto, &[("disk_store_dir", "/tmp/offload-store")]), &small)
        .expect_err("5 GB in 3.85 GB");
    check(
        err.to_string(),
        expect![
            "cannot plan the host copies: unet 4.66 GB (resident; not file-backed) must stay in RAM and need 4.66 GB, 3.59 GB of host RAM usable (5.59 GB available less the 2.00 GB margin); load weights as they are in their files (not quantized or LoRA-fused after loading) so the files serve them, or free 1.07 GB of host RAM"
        ],
    );
    // The same component file-backed plans: it is loaded from its file and keeps no host copy.
    let plan = enable_offload(&whole.with_file_backed(true), Preset::Auto, &small).expect("plans");
    assert_eq!((plan.host_tier, plan.host_bytes), (HostTier::File, 0), "{}", plan.why);
}

#[test]
fn low_ram_safe_reads_every_copy_that_moves_from_its_file_or_store() {
    // RAM to spare, yet low_ram_safe keeps no copy in RAM that a file can serve.
    let plan = plan_pipeline(&z_image_turbo(), Preset::LowRamSafe, &machine(8, 64)).expect("plans");
    check(
        tiers(&plan),
        expect![[r#"
            text_encoder: file (0 B in RAM, 7.49 GB in its tier)
            transformer: file (0 B in RAM, 11.46 GB in its tier)
            vae: file (0 B in RAM, 159.87 MB in its tier)
        "#]],
    );
    assert_eq!((plan.host_bytes(), plan.pinned_bytes()), (0, 0));
    let transformer = plan.component("transformer").expect("planned");
    assert!(transformer.why.contains("preset low_ram_safe spares host RAM"), "{}", transformer.why);

    // Copies no file serves go to the disk store when there is one; the VAE, moving whole, stays in RAM.
    let plan = plan_pipeline(
        &in_ram_only(),
        settings(Preset::LowRamSafe, &[("disk_store_dir", "/tmp/offload-store")]),
        &machine(8, 64),
    )
    .expect("plans");
    check(
        tiers(&plan),
        expect![[r#"
            text_encoder: disk store (0 B in RAM, 7.49 GB in its tier)
            transformer: disk store (0 B in RAM, 11.46 GB in its tier)
            vae: ram (159.87 MB in RAM, 159.87 MB in its tier)
        "#]],
    );
    // Without one they stay in RAM, said in the reason; the preset's default is no warning.
    let plan = plan_pipeline(&in_ram_only(), Preset::LowRamSafe, &machine(8, 64)).expect("plans");
    assert!(plan.components.iter().all(|c| c.host_tier == HostTier::Ram), "{plan}");
    assert!(plan.warnings.is_empty(), "{plan}");
    let transformer = plan.component("transformer").expect("planned");
    assert!(transformer.why.contains("not file-backed and no disk_store_dir is set"), "{}", transformer.why);
    // Set explicitly, low_host_memory without a disk store still warns: the user asked for something not done.
    let plan = plan_pipeline(&in_ram_only(), settings(Preset::Auto, &[("low_host_memory", "true")]), &machine(8, 64))
        .expect("plans");
    check(
        plan.warnings.join("\n"),
        expect![
            "low_host_memory is set, but text_encoder and transformer stay in RAM: their weights are not file-backed and no disk_store_dir is set; set disk_store_dir"
        ],
    );
    // And an explicit low_host_memory=false turns low_ram_safe's default off: copies stay in RAM where they fit.
    let plan =
        plan_pipeline(&z_image_turbo(), settings(Preset::LowRamSafe, &[("low_host_memory", "false")]), &machine(8, 64))
            .expect("plans");
    assert!(plan.components.iter().all(|c| c.host_tier == HostTier::Ram), "{plan}");

    // On 4 GB of RAM (1.35 GB usable) low_ram_safe plans the whole pipeline from its files.
    let plan = plan_pipeline(&z_image_turbo(), Preset::LowRamSafe, &machine(8, 4)).expect("plans on 4 GB of RAM");
    assert!(plan.host_bytes() <= plan.usable_host, "{plan}");
}

#[test]
fn predicted_times_read_the_disk_rate() {
    let text_encoder = z_image_turbo().remove(0);
    let plan_at = |disk: f64| {
        let machine = machine(8, 64);
        let time = machine.time.with_disk_rate(disk);
        let machine = machine.with_time(time);
        enable_offload(&text_encoder, Preset::LowRamSafe, &machine).expect("plans")
    };
    let (slow, fast) = (plan_at(1e9), plan_at(4e9));
    assert_eq!(slow.host_tier, HostTier::File);
    assert!(slow.why.contains("at 1.00 GB/s (given)"), "{}", slow.why);
    // Its one call reads every byte from the file, then copies it as pageable memory, in 37 copies: its 36 layers
    // and the bytes outside them.
    let time = TimeModel::generic().with_disk_rate(1e9);
    let expected = time.transfer_seconds(0, 0, text_encoder.weight_bytes, 37);
    assert!(
        (slow.seconds_per_image - expected).abs() < 1e-9,
        "{} against {expected}: {}",
        slow.seconds_per_image,
        slow.why
    );
    assert!(
        slow.seconds_per_image > 3.0 * fast.seconds_per_image,
        "{} {}",
        slow.seconds_per_image,
        fast.seconds_per_image
    );

    // The plan's header gives the disk rate and its source when a copy reads the disk.
    let machine = machine(8, 64);
    let time = machine.time.with_disk_rate(3e9);
    let plan = plan_pipeline(&z_image_turbo(), Preset::LowRamSafe, &machine.clone().with_time(time)).expect("plans");
    assert!(plan.to_string().contains("\ndisk: 3.00 GB/s read (given)\n"), "{plan}");
    let in_ram = plan_pipeline(&z_image_turbo(), Preset::Auto, &machine).expect("plans");
    assert!(!in_ram.to_string().contains("\ndisk:"), "{in_ram}");
}

#[test]
fn the_plan_shows_host_bytes_per_tier() {
    let plan = plan_pipeline(&z_image_turbo(), Preset::Auto, &machine(8, 16)).expect("plans");
    check(
        plan.to_string(),
        expect![[r#"
            plan for preset auto: device 6.84 GB available of 7.45 GB; host 13.41 GB available of 14.90 GB (11.41 GB usable)
            link: 31.50 GB/s from pinned memory, 15.75 GB/s pageable (assumed, not measured: a run on this device measures it)
            disk: 2.00 GB/s read (assumed, not measured: a run that reads from the files measures it)
            component     route                 host       resident  pinned  streamed/step  time/step     peak
            text_encoder  leaf, prefetch        file+ram  741.88 MB     0 B        7.49 GB    1.753 s  1.25 GB
            transformer   block x1, prefetch 1  file+ram    5.40 GB     0 B        6.74 GB    0.983 s  6.58 GB
            vae           component offload     ram       159.87 MB     0 B      159.87 MB    0.099 s  2.49 GB
            per image (8 steps): 9.71 s predicted, peak 6.58 GB of 6.84 GB available; host copies: 11.40 GB in RAM of 11.41 GB usable, 0 B pinned, 18.96 GB in checkpoint files
            why:
              text_encoder: 7.49 GB of weights do not fit whole in the 6.16 GB left after 696.32 MB for activations (estimate 440.32 MB + margin 256.00 MB, sized from the workload rather than DDO's fixed headroom tiers), so it streams its blocks leaf by leaf with prefetch: at most 95.00 MB of leaves on the device beside the 741.88 MB outside the blocks, which stay resident; 7.49 GB stream in its one call; its host copy is the checkpoint file: the host copies (19.11 GB) do not fit in the 11.41 GB of usable RAM, and reading text_encoder and transformer from disk is the way to fit that costs the least predicted time (+10.18 s per image, against +27.67 s for transformer); 193 of its 252 streamed groups (5.18 GB) keep their host copy in RAM after their first read: the 11.25 GB of RAM the other copies leave is placed over the streamed groups by cost, RAM at 0.063 s per GB against 0.563 s per GB from disk, each group counted once per copy (1 an image), which saves 6.04 s per image in all (text_encoder and transformer) over leaving that RAM to the page cache; its one call reads 2.31 GB from the file at 2.00 GB/s (assumed); predicted 1.753 s per call (copies 1.753 s, compute 0.043 s); nothing pinned: its host copy is the checkpoint file, whose pages are read, not pinned; chosen at 0.51 s per image before its host tier and pinning, over component does not fit (needs 8.17 GB), block 0.51 s per image
              transformer: 11.46 GB of weights do not fit whole in the 6.08 GB left after 778.24 MB for activations (estimate 522.24 MB + margin 256.00 MB, sized from the workload rather than DDO's fixed headroom tiers), so it streams 1 block per group with prefetch depth 1; 16 of 34 groups (5.38 GB) stay resident beside the 22.61 MB outside the blocks; 11.46 GB stream on the first step, 6.07 GB on each later one; its host copy is the checkpoint file: the host copies (19.11 GB) do not fit in the 11.41 GB of usable RAM, and reading text_encoder and transformer from disk is the way to fit that costs the least predicted time (+10.18 s per image, against +27.67 s for transformer); 18 of its 18 streamed groups (6.07 GB) keep their host copy in RAM after their first read: the 11.25 GB of RAM the other copies leave is placed over the streamed groups by cost, RAM at 0.063 s per GB against 0.563 s per GB from disk, each group counted once per copy (8 an image), which saves 6.04 s per image in all (text_encoder and transformer) over leaving that RAM to the page cache; the first step reads 5.40 GB from the file at 2.00 GB/s (assumed), the rest of its 11.46 GB from RAM, each later step its 6.07 GB from RAM (6.07 GB kept there); predicted 0.983 s per step (copies 0.414 s, compute 0.597 s); nothing pinned: its host copy is the checkpoint file, whose pages are read, not pinned; chosen at 4.96 s per image before its host tier and pinning, over component does not fit (needs 12.22 GB), leaf 6.26 s per image
              vae: 159.87 MB of weights fit whole in the 3.92 GB left after 2.92 GB for activations (estimate 2.34 GB + margin 597.98 MB, sized from the workload rather than DDO's fixed headroom tiers), so it moves whole onto the device when it runs (159.87 MB per image); its host copy stays in RAM (159.87 MB): with text_encoder and transformer read from disk, the copies kept in RAM (159.87 MB) fit in the 11.41 GB of usable RAM; predicted 0.099 s per call (copies 0.011 s, compute 0.088 s); nothing pinned: it crosses the link once per image
        "#]],
    );
}

#[test]
fn the_host_tier_setting_keeps_every_copy_in_ram_or_reads_every_file_backed_one_from_its_file() {
    // 32 GB of RAM holds every copy: `file` reads them from their files anyway, and says why.
    let plan = plan_pipeline(&z_image_turbo(), settings(Preset::Auto, &[("host_tier", "file")]), &machine(8, 32))
        .expect("plans");
    let streamed: Vec<&str> =
        plan.components.iter().filter(|c| c.host_tier == HostTier::File).map(|c| c.component.as_str()).collect();
    assert_eq!(streamed, ["text_encoder", "transformer", "vae"], "{plan}");
    let transformer = plan.component("transformer").expect("planned");
    assert!(transformer.why.contains("host_tier is file (from an explicit argument)"), "{}", transformer.why);
    // 16 GB does not hold them: `auto` reads some from their files, `ram` keeps them all in RAM and is refused.
    let auto = plan_pipeline(&z_image_turbo(), Preset::Auto, &machine(8, 16)).expect("plans");
    assert!(auto.components.iter().any(|c| c.host_tier == HostTier::File), "{auto}");
    let refused = plan_pipeline(&z_image_turbo(), settings(Preset::Auto, &[("host_tier", "ram")]), &machine(8, 16));
    assert!(matches!(refused, Err(PlanError::HostDoesNotFit { .. })), "{refused:?}");
    // On 32 GB, `ram` keeps every copy in RAM, as `auto` does there.
    let plan = plan_pipeline(&z_image_turbo(), settings(Preset::LowRamSafe, &[("host_tier", "ram")]), &machine(8, 32))
        .expect("plans");
    assert!(plan.components.iter().all(|c| c.host_tier == HostTier::Ram), "{plan}");
}

#[test]
fn a_short_host_keeps_the_streamed_groups_that_fit_in_ram_and_reads_the_rest_from_the_file() {
    // 9 GB of RAM: 5.54 GB usable. Every copy that can leave RAM leaves; the RAM left holds most of the
    // transformer's streamed groups (a split, placed by cost over RAM and the file), where leaving it to the page
    // cache, which cannot hold a step's 6.07 GB, would read every step from the disk.
    let plan = plan_pipeline(&z_image_turbo(), Preset::Auto, &machine(8, 9)).expect("plans");
    let transformer = plan.component("transformer").expect("planned");
    assert_eq!(transformer.host_tier, HostTier::File);
    assert_eq!(transformer.host_bytes, transformer.ram_streamed_bytes);
    assert!(plan.host_bytes() <= plan.usable_host, "{plan}");
    assert!(plan.table().contains("file+ram"), "{plan}");
    // The groups are whole: 15 of the 18 streamed ones, the rest read from the file at every step.
    assert!(transformer.why.contains("15 of its 18 streamed groups (5.05 GB) keep their host copy in RAM"), "{plan}");
    assert!(transformer.why.contains("each later step 1.01 GB from the file again"), "{plan}");

    // The same plan with the split undone (the RAM left to the page cache) is predicted slower.
    let all_file = plan_pipeline(&z_image_turbo(), settings(Preset::Auto, &[("host_tier", "file")]), &machine(8, 9))
        .expect("plans");
    let unsplit = all_file.component("transformer").expect("planned");
    assert_eq!(unsplit.ram_streamed_bytes, 0, "a host_tier setting reads every file-backed copy from its file");
    assert!(
        transformer.seconds_per_image < unsplit.seconds_per_image * 0.5,
        "{:.2} s split against {:.2} s from the file",
        transformer.seconds_per_image,
        unsplit.seconds_per_image
    );
}
