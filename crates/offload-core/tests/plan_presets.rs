//! Preset resolution at Z-Image-Turbo's real sizes over a matrix of cards and host RAM, as snapshots, and the
//! planner's rules one by one: quantized weights, the full-pin rule, disk stores, overrides, errors.

mod plan_common;

use expect_test::{Expect, expect};
use offload_core::format_size;
use offload_core::plan::{
    BlockLayout, ComponentSpec, HostMemory, Machine, Plan, PlanError, Preset, Route, Settings, SettingsLayer,
    enable_offload, plan_pipeline, presets_table,
};
use plan_common::{machine, z_image_turbo};

const CARDS: [u64; 4] = [8, 12, 16, 24];
const RAMS: [u64; 3] = [16, 32, 64];

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

fn summary(plan: &Plan) -> String {
    format!(
        "{:.2} s/image, peak {} of {}, host {} of {} usable, {} pinned, {} warning(s)",
        plan.seconds_per_image(),
        format_size(plan.peak_bytes()),
        format_size(plan.machine.device_available),
        format_size(plan.host_bytes()),
        format_size(plan.usable_host),
        format_size(plan.pinned_bytes()),
        plan.warnings.len()
    )
}

/// The matrix of one preset: each card and RAM size, its summary and its table.
fn matrix(preset: Preset) -> String {
    let mut out = String::new();
    for card in CARDS {
        for ram in RAMS {
            let plan =
                plan_pipeline(&z_image_turbo(), preset, &machine(card, ram)).expect("Z-Image plans on every card");
            assert!(plan.peak_bytes() <= plan.machine.device_available, "{preset} {card}GB/{ram}GB:\n{plan}");
            out.push_str(&format!("== {card}GB card, {ram}GB RAM: {}\n{}", summary(&plan), plan.table()));
        }
    }
    out
}

#[test]
fn auto_over_cards_and_host_ram() {
    check(
        matrix(Preset::Auto),
        expect![[r#"
            == 8GB card, 16GB RAM: 9.71 s/image, peak 6.58 GB of 6.84 GB, host 11.40 GB of 11.41 GB usable, 0 B pinned, 0 warning(s)
            component     route                 host       resident  pinned  streamed/step  time/step     peak
            text_encoder  leaf, prefetch        file+ram  741.88 MB     0 B        7.49 GB    1.753 s  1.25 GB
            transformer   block x1, prefetch 1  file+ram    5.40 GB     0 B        6.74 GB    0.983 s  6.58 GB
            vae           component offload     ram       159.87 MB     0 B      159.87 MB    0.099 s  2.49 GB
            == 8GB card, 32GB RAM: 5.57 s/image, peak 6.58 GB of 6.84 GB, host 19.11 GB of 23.10 GB usable, 0 B pinned, 0 warning(s)
            component     route                 host   resident  pinned  streamed/step  time/step     peak
            text_encoder  leaf, prefetch        ram   741.88 MB     0 B        7.49 GB    0.513 s  1.25 GB
            transformer   block x1, prefetch 1  ram     5.40 GB     0 B        6.74 GB    0.620 s  6.58 GB
            vae           component offload     ram   159.87 MB     0 B      159.87 MB    0.099 s  2.49 GB
            == 8GB card, 64GB RAM: 5.57 s/image, peak 6.58 GB of 6.84 GB, host 19.11 GB of 46.19 GB usable, 0 B pinned, 0 warning(s)
            component     route                 host   resident  pinned  streamed/step  time/step     peak
            text_encoder  leaf, prefetch        ram   741.88 MB     0 B        7.49 GB    0.513 s  1.25 GB
            transformer   block x1, prefetch 1  ram     5.40 GB     0 B        6.74 GB    0.620 s  6.58 GB
            vae           component offload     ram   159.87 MB     0 B      159.87 MB    0.099 s  2.49 GB
            == 12GB card, 16GB RAM: 10.46 s/image, peak 10.29 GB of 10.57 GB, host 10.01 GB of 11.41 GB usable, 0 B pinned, 0 warning(s)
            component     route                 host       resident  pinned  streamed/step  time/step      peak
            text_encoder  leaf, prefetch        ram       741.88 MB     0 B        7.49 GB    0.513 s   1.25 GB
            transformer   block x1, prefetch 1  file+ram    9.11 GB     0 B        3.50 GB    1.231 s  10.29 GB
            vae           component offload     ram       159.87 MB     0 B      159.87 MB    0.099 s   2.49 GB
            == 12GB card, 32GB RAM: 5.57 s/image, peak 10.29 GB of 10.57 GB, host 19.11 GB of 23.10 GB usable, 0 B pinned, 0 warning(s)
            component     route                 host   resident  pinned  streamed/step  time/step      peak
            text_encoder  leaf, prefetch        ram   741.88 MB     0 B        7.49 GB    0.513 s   1.25 GB
            transformer   block x1, prefetch 1  ram     9.11 GB     0 B        3.50 GB    0.620 s  10.29 GB
            vae           component offload     ram   159.87 MB     0 B      159.87 MB    0.099 s   2.49 GB
            == 12GB card, 64GB RAM: 5.57 s/image, peak 10.29 GB of 10.57 GB, host 19.11 GB of 46.19 GB usable, 0 B pinned, 0 warning(s)
            component     route                 host   resident  pinned  streamed/step  time/step      peak
            text_encoder  leaf, prefetch        ram   741.88 MB     0 B        7.49 GB    0.513 s   1.25 GB
            transformer   block x1, prefetch 1  ram     9.11 GB     0 B        3.50 GB    0.620 s  10.29 GB
            vae           component offload     ram   159.87 MB     0 B      159.87 MB    0.099 s   2.49 GB
            == 16GB card, 16GB RAM: 11.73 s/image, peak 12.65 GB of 14.30 GB, host 7.65 GB of 11.41 GB usable, 0 B pinned, 0 warning(s)
            component     route                 host   resident  pinned  streamed/step  time/step      peak
            text_encoder  leaf, prefetch        ram   741.88 MB     0 B        7.49 GB    0.513 s   1.25 GB
            transformer   block x1, prefetch 1  file   11.46 GB     0 B        1.43 GB    1.390 s  12.65 GB
            vae           component offload     ram   159.87 MB     0 B      159.87 MB    0.099 s   2.49 GB
            == 16GB card, 32GB RAM: 5.57 s/image, peak 12.65 GB of 14.30 GB, host 19.11 GB of 23.10 GB usable, 0 B pinned, 0 warning(s)
            component     route                 host   resident  pinned  streamed/step  time/step      peak
            text_encoder  leaf, prefetch        ram   741.88 MB     0 B        7.49 GB    0.513 s   1.25 GB
            transformer   block x1, prefetch 1  ram    11.46 GB     0 B        1.43 GB    0.620 s  12.65 GB
            vae           component offload     ram   159.87 MB     0 B      159.87 MB    0.099 s   2.49 GB
            == 16GB card, 64GB RAM: 5.57 s/image, peak 12.65 GB of 14.30 GB, host 19.11 GB of 46.19 GB usable, 0 B pinned, 0 warning(s)
            component     route                 host   resident  pinned  streamed/step  time/step      peak
            text_encoder  leaf, prefetch        ram   741.88 MB     0 B        7.49 GB    0.513 s   1.25 GB
            transformer   block x1, prefetch 1  ram    11.46 GB     0 B        1.43 GB    0.620 s  12.65 GB
            vae           component offload     ram   159.87 MB     0 B      159.87 MB    0.099 s   2.49 GB
            == 24GB card, 16GB RAM: 11.73 s/image, peak 12.65 GB of 21.75 GB, host 7.65 GB of 11.41 GB usable, 0 B pinned, 0 warning(s)
            component     route                 host   resident  pinned  streamed/step  time/step      peak
            text_encoder  leaf, prefetch        ram   741.88 MB     0 B        7.49 GB    0.513 s   1.25 GB
            transformer   block x1, prefetch 1  file   11.46 GB     0 B        1.43 GB    1.390 s  12.65 GB
            vae           component offload     ram   159.87 MB     0 B      159.87 MB    0.099 s   2.49 GB
            == 24GB card, 32GB RAM: 5.57 s/image, peak 12.65 GB of 21.75 GB, host 19.11 GB of 23.10 GB usable, 0 B pinned, 0 warning(s)
            component     route                 host   resident  pinned  streamed/step  time/step      peak
            text_encoder  leaf, prefetch        ram   741.88 MB     0 B        7.49 GB    0.513 s   1.25 GB
            transformer   block x1, prefetch 1  ram    11.46 GB     0 B        1.43 GB    0.620 s  12.65 GB
            vae           component offload     ram   159.87 MB     0 B      159.87 MB    0.099 s   2.49 GB
            == 24GB card, 64GB RAM: 5.57 s/image, peak 12.65 GB of 21.75 GB, host 19.11 GB of 46.19 GB usable, 0 B pinned, 0 warning(s)
            component     route                 host   resident  pinned  streamed/step  time/step      peak
            text_encoder  leaf, prefetch        ram   741.88 MB     0 B        7.49 GB    0.513 s   1.25 GB
            transformer   block x1, prefetch 1  ram    11.46 GB     0 B        1.43 GB    0.620 s  12.65 GB
            vae           component offload     ram   159.87 MB     0 B      159.87 MB    0.099 s   2.49 GB
        "#]],
    );
}

#[test]
fn one_shot_fast_over_cards_and_host_ram() {
    check(
        matrix(Preset::OneShotFast),
        expect![[r#"
            == 8GB card, 16GB RAM: 9.77 s/image, peak 6.58 GB of 6.84 GB, host 11.30 GB of 11.41 GB usable, 0 B pinned, 0 warning(s)
            component     route                 host       resident  pinned  streamed/step  time/step     peak
            text_encoder  block x1, prefetch 1  file+ram  741.88 MB     0 B        7.49 GB    1.808 s  1.53 GB
            transformer   block x1, prefetch 1  file+ram    5.40 GB     0 B        6.74 GB    0.983 s  6.58 GB
            vae           component offload     ram       159.87 MB     0 B      159.87 MB    0.099 s  2.49 GB
            == 8GB card, 32GB RAM: 5.39 s/image, peak 6.58 GB of 6.84 GB, host 19.11 GB of 23.10 GB usable, 6.07 GB pinned, 0 warning(s)
            component     route                 host   resident   pinned  streamed/step  time/step     peak
            text_encoder  block x1, prefetch 1  ram   741.88 MB      0 B        7.49 GB    0.511 s  1.53 GB
            transformer   block x1, prefetch 1  ram     5.40 GB  6.07 GB        6.74 GB    0.597 s  6.58 GB
            vae           component offload     ram   159.87 MB      0 B      159.87 MB    0.099 s  2.49 GB
            == 8GB card, 64GB RAM: 5.39 s/image, peak 6.58 GB of 6.84 GB, host 19.11 GB of 46.19 GB usable, 6.07 GB pinned, 0 warning(s)
            component     route                 host   resident   pinned  streamed/step  time/step     peak
            text_encoder  block x1, prefetch 1  ram   741.88 MB      0 B        7.49 GB    0.511 s  1.53 GB
            transformer   block x1, prefetch 1  ram     5.40 GB  6.07 GB        6.74 GB    0.597 s  6.58 GB
            vae           component offload     ram   159.87 MB      0 B      159.87 MB    0.099 s  2.49 GB
            == 12GB card, 16GB RAM: 10.50 s/image, peak 10.29 GB of 10.57 GB, host 10.01 GB of 11.41 GB usable, 0 B pinned, 0 warning(s)
            component     route                 host       resident  pinned  streamed/step  time/step      peak
            text_encoder  component offload     ram         7.49 GB     0 B        7.49 GB    0.554 s   7.92 GB
            transformer   block x1, prefetch 1  file+ram    9.11 GB     0 B        3.50 GB    1.231 s  10.29 GB
            vae           component offload     ram       159.87 MB     0 B      159.87 MB    0.099 s   2.49 GB
            == 12GB card, 32GB RAM: 5.53 s/image, peak 10.29 GB of 10.57 GB, host 19.11 GB of 23.10 GB usable, 2.36 GB pinned, 0 warning(s)
            component     route                 host   resident   pinned  streamed/step  time/step      peak
            text_encoder  component offload     ram     7.49 GB      0 B        7.49 GB    0.554 s   7.92 GB
            transformer   block x1, prefetch 1  ram     9.11 GB  2.36 GB        3.50 GB    0.610 s  10.29 GB
            vae           component offload     ram   159.87 MB      0 B      159.87 MB    0.099 s   2.49 GB
            == 12GB card, 64GB RAM: 5.53 s/image, peak 10.29 GB of 10.57 GB, host 19.11 GB of 46.19 GB usable, 2.36 GB pinned, 0 warning(s)
            component     route                 host   resident   pinned  streamed/step  time/step      peak
            text_encoder  component offload     ram     7.49 GB      0 B        7.49 GB    0.554 s   7.92 GB
            transformer   block x1, prefetch 1  ram     9.11 GB  2.36 GB        3.50 GB    0.610 s  10.29 GB
            vae           component offload     ram   159.87 MB      0 B      159.87 MB    0.099 s   2.49 GB
            == 16GB card, 16GB RAM: 12.37 s/image, peak 11.97 GB of 14.30 GB, host 7.65 GB of 11.41 GB usable, 0 B pinned, 0 warning(s)
            component     route              host   resident  pinned  streamed/step  time/step      peak
            text_encoder  component offload  ram     7.49 GB     0 B        7.49 GB    0.554 s   7.92 GB
            transformer   component offload  file   11.46 GB     0 B        1.43 GB    1.464 s  11.97 GB
            vae           component offload  ram   159.87 MB     0 B      159.87 MB    0.099 s   2.49 GB
            == 16GB card, 32GB RAM: 6.21 s/image, peak 11.97 GB of 14.30 GB, host 19.11 GB of 23.10 GB usable, 0 B pinned, 0 warning(s)
            component     route              host   resident  pinned  streamed/step  time/step      peak
            text_encoder  component offload  ram     7.49 GB     0 B        7.49 GB    0.554 s   7.92 GB
            transformer   component offload  ram    11.46 GB     0 B        1.43 GB    0.695 s  11.97 GB
            vae           component offload  ram   159.87 MB     0 B      159.87 MB    0.099 s   2.49 GB
            == 16GB card, 64GB RAM: 6.21 s/image, peak 11.97 GB of 14.30 GB, host 19.11 GB of 46.19 GB usable, 0 B pinned, 0 warning(s)
            component     route              host   resident  pinned  streamed/step  time/step      peak
            text_encoder  component offload  ram     7.49 GB     0 B        7.49 GB    0.554 s   7.92 GB
            transformer   component offload  ram    11.46 GB     0 B        1.43 GB    0.695 s  11.97 GB
            vae           component offload  ram   159.87 MB     0 B      159.87 MB    0.099 s   2.49 GB
            == 24GB card, 16GB RAM: 12.37 s/image, peak 11.97 GB of 21.75 GB, host 7.65 GB of 11.41 GB usable, 0 B pinned, 0 warning(s)
            component     route              host   resident  pinned  streamed/step  time/step      peak
            text_encoder  component offload  ram     7.49 GB     0 B        7.49 GB    0.554 s   7.92 GB
            transformer   component offload  file   11.46 GB     0 B        1.43 GB    1.464 s  11.97 GB
            vae           component offload  ram   159.87 MB     0 B      159.87 MB    0.099 s   2.49 GB
            == 24GB card, 32GB RAM: 6.21 s/image, peak 11.97 GB of 21.75 GB, host 19.11 GB of 23.10 GB usable, 0 B pinned, 0 warning(s)
            component     route              host   resident  pinned  streamed/step  time/step      peak
            text_encoder  component offload  ram     7.49 GB     0 B        7.49 GB    0.554 s   7.92 GB
            transformer   component offload  ram    11.46 GB     0 B        1.43 GB    0.695 s  11.97 GB
            vae           component offload  ram   159.87 MB     0 B      159.87 MB    0.099 s   2.49 GB
            == 24GB card, 64GB RAM: 6.21 s/image, peak 11.97 GB of 21.75 GB, host 19.11 GB of 46.19 GB usable, 0 B pinned, 0 warning(s)
            component     route              host   resident  pinned  streamed/step  time/step      peak
            text_encoder  component offload  ram     7.49 GB     0 B        7.49 GB    0.554 s   7.92 GB
            transformer   component offload  ram    11.46 GB     0 B        1.43 GB    0.695 s  11.97 GB
            vae           component offload  ram   159.87 MB     0 B      159.87 MB    0.099 s   2.49 GB
        "#]],
    );
}

#[test]
fn every_preset_on_an_8gb_card_with_32gb_of_ram() {
    let mut out = String::new();
    for preset in Preset::ALL {
        let plan = plan_pipeline(&z_image_turbo(), preset, &machine(8, 32)).expect("every preset plans Z-Image on 8GB");
        out.push_str(&format!("== {preset}: {}\n{}", summary(&plan), plan.table()));
    }
    check(
        out,
        expect![[r#"
            == auto: 5.57 s/image, peak 6.58 GB of 6.84 GB, host 19.11 GB of 23.10 GB usable, 0 B pinned, 0 warning(s)
            component     route                 host   resident  pinned  streamed/step  time/step     peak
            text_encoder  leaf, prefetch        ram   741.88 MB     0 B        7.49 GB    0.513 s  1.25 GB
            transformer   block x1, prefetch 1  ram     5.40 GB     0 B        6.74 GB    0.620 s  6.58 GB
            vae           component offload     ram   159.87 MB     0 B      159.87 MB    0.099 s  2.49 GB
            == one_shot_fast: 5.39 s/image, peak 6.58 GB of 6.84 GB, host 19.11 GB of 23.10 GB usable, 6.07 GB pinned, 0 warning(s)
            component     route                 host   resident   pinned  streamed/step  time/step     peak
            text_encoder  block x1, prefetch 1  ram   741.88 MB      0 B        7.49 GB    0.511 s  1.53 GB
            transformer   block x1, prefetch 1  ram     5.40 GB  6.07 GB        6.74 GB    0.597 s  6.58 GB
            vae           component offload     ram   159.87 MB      0 B      159.87 MB    0.099 s  2.49 GB
            == low_ram_safe: 17.12 s/image, peak 2.49 GB of 6.84 GB, host 0 B of 23.10 GB usable, 0 B pinned, 0 warning(s)
            component     route                 host   resident  pinned  streamed/step  time/step     peak
            text_encoder  block x1, prefetch 1  file  741.88 MB     0 B        7.49 GB    4.534 s  1.53 GB
            transformer   block x1, prefetch 1  file   22.61 MB     0 B       11.45 GB    1.550 s  1.21 GB
            vae           component offload     file  159.87 MB     0 B      159.87 MB    0.183 s  2.49 GB
            == warm_process: 5.13 s/image, peak 6.58 GB of 6.84 GB, host 19.11 GB of 23.10 GB usable, 19.11 GB pinned, 0 warning(s)
            component     route                 host   resident     pinned  streamed/step  time/step     peak
            text_encoder  block x1, prefetch 1  ram   741.88 MB    7.49 GB        7.49 GB    0.256 s  1.53 GB
            transformer   block x1, prefetch 1  ram     5.40 GB   11.46 GB        6.74 GB    0.597 s  6.58 GB
            vae           component offload     ram   159.87 MB  159.87 MB      159.87 MB    0.093 s  2.49 GB
            == diffusers_offload_compat: 6.85 s/image, peak 2.49 GB of 6.84 GB, host 19.11 GB of 23.10 GB usable, 0 B pinned, 0 warning(s)
            component     route                 host   resident  pinned  streamed/step  time/step     peak
            text_encoder  block x1, prefetch 1  ram   741.88 MB     0 B        7.49 GB    0.511 s  1.53 GB
            transformer   block x1, prefetch 1  ram    22.61 MB     0 B       11.45 GB    0.781 s  1.21 GB
            vae           component offload     ram   159.87 MB     0 B      159.87 MB    0.099 s  2.49 GB
            == diffusers_leaf_offload_compat: 6.88 s/image, peak 2.49 GB of 6.84 GB, host 19.11 GB of 23.10 GB usable, 0 B pinned, 0 warning(s)
            component     route              host   resident  pinned  streamed/step  time/step       peak
            text_encoder  leaf, prefetch     ram   741.88 MB     0 B        7.49 GB    0.513 s    1.25 GB
            transformer   leaf, prefetch     ram    22.61 MB     0 B       11.45 GB    0.783 s  694.85 MB
            vae           component offload  ram   159.87 MB     0 B      159.87 MB    0.099 s    2.49 GB
            == no_pin: 8.95 s/image, peak 6.58 GB of 6.84 GB, host 19.11 GB of 23.10 GB usable, 0 B pinned, 0 warning(s)
            component     route                  host   resident  pinned  streamed/step  time/step     peak
            text_encoder  block x1, no prefetch  ram   741.88 MB     0 B        7.49 GB    0.554 s  1.34 GB
            transformer   block x1, no prefetch  ram     5.74 GB     0 B        6.45 GB    1.037 s  6.58 GB
            vae           component offload      ram   159.87 MB     0 B      159.87 MB    0.099 s  2.49 GB
            == off: 4.91 s/image, peak 21.45 GB of 6.84 GB, host 0 B of 23.10 GB usable, 0 B pinned, 0 warning(s)
            component     route  host   resident  pinned  streamed/step  time/step      peak
            text_encoder  off    file    7.49 GB     0 B            0 B    0.043 s  19.54 GB
            transformer   off    file   11.46 GB     0 B            0 B    0.597 s  19.62 GB
            vae           off    file  159.87 MB     0 B            0 B    0.088 s  21.45 GB
        "#]],
    );
}

#[test]
fn the_full_plan_explains_every_choice() {
    let plan = plan_pipeline(&z_image_turbo(), Preset::Auto, &machine(8, 32)).expect("plans");
    check(
        plan.to_string(),
        expect![[r#"
            plan for preset auto: device 6.84 GB available of 7.45 GB; host 26.82 GB available of 29.80 GB (23.10 GB usable)
            link: 31.50 GB/s from pinned memory, 15.75 GB/s pageable (assumed, not measured: a run on this device measures it)
            component     route                 host   resident  pinned  streamed/step  time/step     peak
            text_encoder  leaf, prefetch        ram   741.88 MB     0 B        7.49 GB    0.513 s  1.25 GB
            transformer   block x1, prefetch 1  ram     5.40 GB     0 B        6.74 GB    0.620 s  6.58 GB
            vae           component offload     ram   159.87 MB     0 B      159.87 MB    0.099 s  2.49 GB
            per image (8 steps): 5.57 s predicted, peak 6.58 GB of 6.84 GB available; host copies: 19.11 GB in RAM of 23.10 GB usable, 0 B pinned
            why:
              text_encoder: 7.49 GB of weights do not fit whole in the 6.16 GB left after 696.32 MB for activations (estimate 440.32 MB + margin 256.00 MB, sized from the workload rather than DDO's fixed headroom tiers), so it streams its blocks leaf by leaf with prefetch: at most 95.00 MB of leaves on the device beside the 741.88 MB outside the blocks, which stay resident; 7.49 GB stream in its one call; its host copy stays in RAM (7.49 GB): the host copies (19.11 GB) fit in the 23.10 GB of usable RAM; predicted 0.513 s per call (copies 0.513 s, compute 0.043 s); nothing pinned: it crosses the link once per image; chosen at 0.51 s per image before pinning, over component does not fit (needs 8.17 GB), block 0.51 s per image
              transformer: 11.46 GB of weights do not fit whole in the 6.08 GB left after 778.24 MB for activations (estimate 522.24 MB + margin 256.00 MB, sized from the workload rather than DDO's fixed headroom tiers), so it streams 1 block per group with prefetch depth 1; 16 of 34 groups (5.38 GB) stay resident beside the 22.61 MB outside the blocks; 11.46 GB stream on the first step, 6.07 GB on each later one; its host copy stays in RAM (11.46 GB): the host copies (19.11 GB) fit in the 23.10 GB of usable RAM; predicted 0.620 s per step (copies 0.414 s, compute 0.597 s); nothing pinned: pinning would save 0.18 s of 4.96 s per image, under 5%, as pageable copies (0.414 s a step) mostly hide under compute (0.597 s); chosen at 4.96 s per image before pinning, over component does not fit (needs 12.22 GB), leaf 6.26 s per image
              vae: 159.87 MB of weights fit whole in the 3.92 GB left after 2.92 GB for activations (estimate 2.34 GB + margin 597.98 MB, sized from the workload rather than DDO's fixed headroom tiers), so it moves whole onto the device when it runs (159.87 MB per image); its host copy stays in RAM (159.87 MB): the host copies (19.11 GB) fit in the 23.10 GB of usable RAM; predicted 0.099 s per call (copies 0.011 s, compute 0.088 s); nothing pinned: it crosses the link once per image
        "#]],
    );
}

#[test]
fn every_preset_plans_every_machine_within_the_card() {
    for preset in Preset::ALL {
        for card in CARDS {
            for ram in RAMS {
                let plan = plan_pipeline(&z_image_turbo(), preset, &machine(card, ram)).expect("plans");
                assert_eq!(plan.components.len(), 3);
                assert!(
                    preset == Preset::Off || plan.peak_bytes() <= plan.machine.device_available,
                    "{preset} {card}/{ram}:\n{plan}"
                );
                for c in &plan.components {
                    assert!(!c.why.is_empty());
                    if preset != Preset::Off {
                        assert!(c.why.contains("fit") || c.why.contains("resident"), "{}", c.why);
                    }
                }
            }
        }
    }
}

#[test]
fn auto_says_it_sizes_headroom_from_the_workload_not_tiers() {
    let plan = plan_pipeline(&z_image_turbo(), Preset::Auto, &machine(8, 32)).expect("plans");
    let transformer = plan.component("transformer").expect("planned");
    assert!(transformer.why.contains("rather than DDO's fixed headroom tiers"), "{}", transformer.why);
    assert!(transformer.why.contains("estimate 522.24 MB + margin 256.00 MB"), "{}", transformer.why);
}

#[test]
fn the_whole_pipeline_stays_resident_when_it_fits() {
    let plan = plan_pipeline(&z_image_turbo(), Preset::Auto, &machine(40, 64)).expect("plans");
    assert!(plan.components.iter().all(|c| c.route == Route::Resident), "{plan}");
    assert!(plan.components.iter().all(|c| c.streamed_per_image == 0));
    assert!(plan.components[0].why.starts_with("everything fits at once"), "{}", plan.components[0].why);
    // The VAE's 2.34 GB of activations ride on top of everything else resident.
    assert_eq!(plan.peak_bytes(), plan.component("vae").map(|c| c.peak_bytes).unwrap_or_default());
    // low_ram_safe never keeps the whole pipeline.
    let safe = plan_pipeline(&z_image_turbo(), Preset::LowRamSafe, &machine(40, 64)).expect("plans");
    assert!(safe.components.iter().all(|c| c.route == Route::ComponentOffload), "{safe}");
}

#[test]
fn off_routes_nothing() {
    let plan = plan_pipeline(&z_image_turbo(), Preset::Off, &machine(8, 32)).expect("plans");
    assert!(plan.components.iter().all(|c| c.route == Route::Off));
    assert!(plan.components[1].why.starts_with("preset off"), "{}", plan.components[1].why);
}

#[test]
fn quantized_weights_are_routed_as_float_weights_of_the_same_size_and_stream_when_they_do_not_fit() {
    let quantized: Vec<ComponentSpec> = z_image_turbo().into_iter().map(|c| c.quantized(true)).collect();
    // Quantized weights stream as they are, so a quantized component of the same sizes takes the same route under
    // every preset, on a card where each fits whole and on one where the transformer must stream.
    for (vram, ram) in [(24, 64), (8, 32), (3, 64)] {
        for preset in Preset::ALL {
            let float = plan_pipeline(&z_image_turbo(), preset, &machine(vram, ram));
            let plan = plan_pipeline(&quantized, preset, &machine(vram, ram));
            let (float, plan) = match (float, plan) {
                (Ok(float), Ok(plan)) => (float, plan),
                (Err(float), Err(plan)) => {
                    assert_eq!(float.to_string(), plan.to_string(), "{preset} on {vram}GB");
                    continue;
                }
                (float, plan) => panic!("{preset} on {vram}GB: float {float:?}, quantized {plan:?}"),
            };
            for (f, q) in float.components.iter().zip(&plan.components) {
                assert_eq!(f.route, q.route, "{preset} on {vram}GB: {}", q.component);
                let explained = q.why.contains("its weights are quantized") || q.why.starts_with("preset off");
                assert!(explained || q.why.starts_with("everything fits at once"), "{preset}: {}", q.why);
            }
        }
    }
    // On an 8GB card the quantized transformer does not fit whole, so it streams by blocks, as a float one does.
    let plan = plan_pipeline(&quantized, Preset::Auto, &machine(8, 32)).expect("streams");
    let transformer = plan.components.iter().find(|c| c.component == "transformer").expect("planned");
    assert!(transformer.route.is_group_offload(), "{}: {}", transformer.route, transformer.why);
    assert!(transformer.why.starts_with("its weights are quantized"), "{}", transformer.why);
}

#[test]
fn one_shot_fast_pins_everything_and_keeps_nothing_resident_at_four_times_the_card() {
    // 11.46 GB on a 3GB card is 4.1x: the full-pin rule applies.
    let transformer = z_image_turbo().remove(1);
    let plan = enable_offload(&transformer, Preset::OneShotFast, &machine(3, 64)).expect("plans");
    assert!(matches!(plan.route, Route::BlockGroupOffload { .. }), "{}", plan.route);
    assert_eq!(plan.resident_bytes, 0, "{}", plan.why);
    assert_eq!(plan.pinned_bytes, transformer.weight_bytes, "{}", plan.why);
    assert!(plan.why.contains("4.1x the card, at least the full-pin ratio 4"), "{}", plan.why);
    // A ratio above 4.1 (or 0) turns the rule off: a resident budget and only the streamed groups pinned.
    for ratio in ["4.2", "0"] {
        let off =
            enable_offload(&transformer, settings(Preset::OneShotFast, &[("full_pin_ratio", ratio)]), &machine(3, 64))
                .expect("plans");
        assert!(off.resident_bytes > 0, "ratio {ratio}: {}", off.why);
        assert!(off.pinned_bytes < transformer.weight_bytes, "ratio {ratio}: {}", off.why);
    }
    // auto sizes from the activation estimate instead: it keeps what fits.
    let auto = enable_offload(&transformer, Preset::Auto, &machine(3, 64)).expect("plans");
    assert!(auto.resident_bytes > 0, "{}", auto.why);
    // Not enough RAM for the whole host copy: no full pin.
    let small_ram = enable_offload(&transformer, Preset::OneShotFast, &machine(3, 16)).expect("plans");
    assert!(small_ram.resident_bytes > 0, "{}", small_ram.why);
}

#[test]
fn explicit_settings_override_the_preset() {
    let plan = plan_pipeline(
        &z_image_turbo(),
        settings(Preset::Auto, &[("blocks_per_group", "2"), ("prefetch", "false"), ("resident_budget", "2GiB")]),
        &machine(8, 32),
    )
    .expect("plans");
    let transformer = plan.component("transformer").expect("planned");
    assert_eq!(transformer.route, Route::BlockGroupOffload { blocks_per_group: 2, prefetch: false, depth: 1 });
    assert!(transformer.resident_bytes <= (2 << 30) + (23_704_704), "{}", transformer.why);
    assert!(transformer.why.contains("resident_budget 2.00 GB from an explicit argument"), "{}", transformer.why);

    // A resident budget that leaves no room for activations rules block offload out, and says so.
    let plan = plan_pipeline(&z_image_turbo(), settings(Preset::Auto, &[("resident_budget", "7GiB")]), &machine(8, 32));
    let plan = plan.expect("plans");
    let warning = plan.warnings.iter().find(|w| w.starts_with("transformer: resident_budget 7.00 GB"));
    check(
        warning.cloned().unwrap_or_default(),
        expect![
            "transformer: resident_budget 7.00 GB (from an explicit argument) makes block offload need 8.18 GB of the 6.84 GB available, so it took leaf, prefetch instead; lower resident_budget"
        ],
    );
    // Where only block offload is allowed, it is an error naming the setting.
    let err = plan_pipeline(
        &z_image_turbo(),
        settings(Preset::DiffusersOffloadCompat, &[("resident_budget", "7GiB")]),
        &machine(8, 32),
    )
    .expect_err("does not fit");
    assert!(err.to_string().contains("lower resident_budget"), "{err}");

    // A reserve replaces the activation estimate.
    let plan = plan_pipeline(&z_image_turbo(), settings(Preset::Auto, &[("reserve", "3GiB")]), &machine(8, 32))
        .expect("plans");
    let transformer = plan.component("transformer").expect("planned");
    assert_eq!(transformer.headroom_bytes, 3 << 30);
    assert!(transformer.why.contains("the reserve setting from an explicit argument"), "{}", transformer.why);

    // The pinned budget caps what one_shot_fast pins.
    let plan =
        plan_pipeline(&z_image_turbo(), settings(Preset::OneShotFast, &[("pinned_budget", "1GiB")]), &machine(8, 32))
            .expect("plans");
    assert_eq!(plan.pinned_bytes(), 1 << 30, "{plan}");
    assert!(plan.component("transformer").is_some_and(|c| c.why.contains("limited by the pinned_budget setting")));
}

#[test]
fn short_host_ram_moves_streamed_copies_that_no_file_serves_to_a_disk_store() {
    // Weights changed after loading (quantized, LoRA-fused): their checkpoint files cannot serve them.
    let changed: Vec<ComponentSpec> = z_image_turbo().into_iter().map(|c| c.with_file_backed(false)).collect();
    // Without a disk store, a host that cannot hold them is an error before anything loads, not a swapping run.
    let err = plan_pipeline(&changed, Preset::Auto, &machine(12, 16)).expect_err("does not fit");
    assert!(matches!(err, PlanError::HostDoesNotFit { .. }) && err.to_string().contains("set disk_store_dir"), "{err}");

    let plan =
        plan_pipeline(&changed, settings(Preset::Auto, &[("disk_store_dir", "/tmp/offload-store")]), &machine(12, 16))
            .expect("plans");
    assert!(plan.host_bytes() <= plan.usable_host, "{plan}");
    let transformer = plan.component("transformer").expect("planned");
    // The RAM the other copies leave keeps its streamed groups once read from the store (a split).
    assert!(transformer.on_disk && transformer.host_bytes == transformer.ram_streamed_bytes, "{}", transformer.why);
    assert!(transformer.ram_streamed_bytes > 0, "{}", transformer.why);
    assert!(transformer.why.contains("on disk under /tmp/offload-store"), "{}", transformer.why);
    assert!(plan.warnings.is_empty(), "{plan}");

    // low_host_memory sends every streamed copy to disk and pins nothing, even with RAM to spare.
    let plan = plan_pipeline(
        &changed,
        settings(Preset::OneShotFast, &[("disk_store_dir", "/tmp/offload-store"), ("low_host_memory", "true")]),
        &machine(8, 64),
    )
    .expect("plans");
    assert_eq!(plan.pinned_bytes(), 0);
    assert!(plan.components.iter().filter(|c| c.route.is_group_offload()).all(|c| c.on_disk), "{plan}");
}

#[test]
fn host_available_setting_replaces_the_reading() {
    let plan = plan_pipeline(&z_image_turbo(), settings(Preset::Auto, &[("host_available", "10GB")]), &machine(8, 64))
        .expect("plans");
    assert_eq!(plan.machine.host.available, 10_000_000_000);
    assert_eq!(plan.machine.host.total, 64_000_000_000);
}

#[test]
fn a_component_that_cannot_fit_is_a_typed_error() {
    let vae = z_image_turbo().remove(2);
    let tiny = Machine::new(2_000_000_000, 1_500_000_000, HostMemory::new(16 << 30, 12 << 30));
    let err = enable_offload(&vae, Preset::Auto, &tiny).expect_err("2.34 GB of activations do not fit in 1.5 GB");
    assert!(matches!(err, PlanError::DoesNotFit { ref component, .. } if component == "vae"));
    check(
        err.to_string(),
        expect![
            "cannot plan vae: component offload needs 3.08 GB on the device, 1.40 GB available (2.92 GB kept free for activations); use a larger card, a smaller workload (resolution, caption length), or a smaller reserve"
        ],
    );
}

#[test]
fn inconsistent_components_are_refused() {
    let bad_layout = ComponentSpec::new("transformer", 1000).with_layout(BlockLayout {
        block_bytes: vec![400, 400],
        outside_bytes: 100,
        largest_leaf_bytes: 10,
        leaf_count: 4,
        first_leaf_bytes: 10,
        leaf_bytes: Vec::new(),
    });
    let err = enable_offload(&bad_layout, Preset::Auto, &machine(8, 32)).expect_err("900 is not 1000");
    check(
        err.to_string(),
        expect![[
            r#"invalid description of component "transformer": its blocks (800 B in 2 blocks) and the bytes outside them (100 B) do not add up to its weights (1000 B); count everything outside the blocks as outside_bytes"#
        ]],
    );
    let twice = vec![ComponentSpec::new("vae", 10), ComponentSpec::new("vae", 20)];
    let err = plan_pipeline(&twice, Preset::Auto, &machine(8, 32)).expect_err("duplicate");
    assert!(err.to_string().contains("two components have this name"), "{err}");
    let err = enable_offload(&ComponentSpec::new("", 10), Preset::Auto, &machine(8, 32)).expect_err("no name");
    assert!(err.to_string().contains("the name is empty"), "{err}");
    let err = enable_offload(&ComponentSpec::new("x", 10).with_cost(1.0, 0), Preset::Auto, &machine(8, 32))
        .expect_err("0 calls");
    assert!(err.to_string().contains("called 0 times"), "{err}");
}

#[test]
fn presets_parse_from_their_names_and_refuse_others() {
    for preset in Preset::ALL {
        assert_eq!(preset.name().parse::<Preset>().ok(), Some(preset));
        assert_eq!(preset.to_string(), preset.name());
    }
    assert_eq!("WSL".parse::<Preset>().ok(), None);
    let err = "wsl_compat".parse::<Preset>().expect_err("not ours");
    check(
        err.to_string(),
        expect![[
            r#"unknown preset "wsl_compat"; use one of: auto, one_shot_fast, low_ram_safe, warm_process, diffusers_offload_compat, diffusers_leaf_offload_compat, no_pin, off"#
        ]],
    );
}

#[test]
fn compat_presets_stream_with_diffusers_defaults() {
    let plan = plan_pipeline(&z_image_turbo(), Preset::DiffusersOffloadCompat, &machine(24, 64)).expect("plans");
    let block = Route::BlockGroupOffload { blocks_per_group: 1, prefetch: true, depth: 1 };
    assert_eq!(plan.component("transformer").map(|c| c.route), Some(block));
    assert_eq!(plan.component("text_encoder").map(|c| c.route), Some(block));
    assert_eq!(plan.component("vae").map(|c| c.route), Some(Route::ComponentOffload));
    assert_eq!(plan.pinned_bytes(), 0);
    // No resident budget: only the bytes outside the blocks stay.
    assert_eq!(plan.component("transformer").map(|c| c.resident_bytes), Some(23_704_704));

    let plan = plan_pipeline(&z_image_turbo(), Preset::DiffusersLeafOffloadCompat, &machine(24, 64)).expect("plans");
    assert_eq!(plan.component("transformer").map(|c| c.route), Some(Route::LeafGroupOffload { prefetch: true }));

    let plan = plan_pipeline(&z_image_turbo(), Preset::NoPin, &machine(8, 32)).expect("plans");
    assert_eq!(plan.pinned_bytes(), 0);
    assert!(plan.components.iter().all(|c| !matches!(c.route, Route::BlockGroupOffload { prefetch: true, .. })));
}

#[test]
fn the_documented_preset_table_matches_the_presets() {
    let table = presets_table();
    let docs = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/presets.md"))
        .expect("docs/presets.md");
    assert!(
        docs.contains(&table),
        "docs/presets.md must contain the preset table exactly as presets_table() prints it:\n{table}"
    );
}
