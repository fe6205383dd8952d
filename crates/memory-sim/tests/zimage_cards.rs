//! Z-Image-Turbo at real sizes on simulated cards: the anchor's published 20GB record and its four declared
//! card expectations, reproduced by the production manager on virtual components.

use expect_test::{Expect, expect};
use memory_sim::expect::diff;
use memory_sim::{CardSpec, Expectations, Mode, PipelineProfile, RunOptions, SimRun, simulate};
use offload_core::{Action, OffloadEvent};

const GIB: f64 = (1u64 << 30) as f64;

fn run(card: &str) -> SimRun {
    simulate(&PipelineProfile::z_image_turbo(4), CardSpec::parse(card).unwrap(), &RunOptions::default()).unwrap()
}

/// The anchor's docs table for a 20GB card, as the rows it published (sizes exact, readings in GiB).
#[test]
fn reproduces_the_published_20gb_record() {
    let run = run("20GB");
    let rows = run.record.rows();
    let published: [(&str, Option<&str>, f64, f64); 3] = [
        ("text_encoder", None, 18.02, 8704.0 / GIB),
        ("transformer", Some("text_encoder"), 10.38, 7.77),
        ("vae", None, 6.36, 12.07),
    ];
    assert_eq!(rows.len(), published.len(), "{}", run.record);
    for (row, (onload, offloaded, available, peak)) in rows.iter().zip(published) {
        let (id, bytes) = row.onload.clone().unwrap();
        assert!(id.starts_with(onload), "{id}");
        let expected_bytes = PipelineProfile::z_image_turbo(4).component(onload).unwrap().bytes;
        assert_eq!(bytes, expected_bytes);
        let names: Vec<&str> = row.offloaded.iter().map(|(id, _)| memory_sim::expect::name_of(id)).collect();
        assert_eq!(names, offloaded.into_iter().collect::<Vec<_>>());
        let got_available = row.available.unwrap() as f64 / GIB;
        let got_peak = row.peak.unwrap() as f64 / GIB;
        assert!((got_available - available).abs() < 0.05, "{onload}: available {got_available:.3} vs {available}");
        assert!((got_peak - peak).abs() < 0.05, "{onload}: peak {got_peak:.3} vs {peak}");
    }
    assert!((run.peak as f64 / GIB - 14.15).abs() < 0.05, "whole-run peak {}", run.peak as f64 / GIB);
}

fn check_card(card: &str, record: Expect) {
    let expectations = Expectations::z_image_turbo();
    let run = run(card);
    let declared = expectations.for_card(card).unwrap();
    if let Some(difference) = diff(declared, &run.observed()) {
        panic!("card {card} differs from its declaration:\n{difference}\n{}", run.record);
    }
    assert_eq!(run.error, None);
    record.assert_eq(&run.record.to_string());
}

#[test]
fn card_32gb() {
    check_card(
        "32GB",
        expect![[r#"
        # | Onload                   | Offloaded | Available | Peak     | Reason
        ------------------------------------------------------------------------
        1 | text_encoder_1 (7.49 GB) | -         | 29.20 GB  | 0 B      |
        2 | transformer_2 (11.46 GB) | -         | 21.55 GB  | 7.77 GB  |
        3 | vae_3 (159.87 MB)        | -         | 10.04 GB  | 19.57 GB |"#]],
    );
}

#[test]
fn card_24gb() {
    check_card(
        "24GB",
        expect![[r#"
        # | Onload                   | Offloaded                | Available | Peak     | Reason
        ---------------------------------------------------------------------------------------
        1 | text_encoder_1 (7.49 GB) | -                        | 21.75 GB  | 0 B      |
        2 | transformer_2 (11.46 GB) | text_encoder_1 (7.49 GB) | 14.10 GB  | 7.77 GB  |
        3 | vae_3 (159.87 MB)        | -                        | 10.08 GB  | 12.07 GB |"#]],
    );
}

#[test]
fn card_16gb() {
    check_card(
        "16GB",
        expect![[r#"
        # | Onload                   | Offloaded                | Available | Peak     | Reason
        ---------------------------------------------------------------------------------------
        1 | text_encoder_1 (7.49 GB) | -                        | 14.30 GB  | 0 B      |
        2 | transformer_2 (11.46 GB) | text_encoder_1 (7.49 GB) | 6.65 GB   | 7.77 GB  |
        3 | vae_3 (159.87 MB)        | transformer_2 (11.46 GB) | 2.63 GB   | 12.07 GB |"#]],
    );
}

#[test]
fn card_10gb() {
    check_card(
        "10GB",
        expect![[r#"
        # | Onload                   | Offloaded                | Available | Peak     | Reason
        ---------------------------------------------------------------------------------------
        1 | text_encoder_1 (7.49 GB) | -                        | 8.71 GB   | 0 B      |
        2 | transformer_2 (11.46 GB) | text_encoder_1 (7.49 GB) | 1.06 GB   | 7.77 GB  |
        3 | vae_3 (159.87 MB)        | transformer_2 (11.46 GB) | 0 B       | 12.07 GB |"#]],
    );
}

/// In hard mode a 10GB card cannot hold the transformer at all: the run stops with the advice to use group
/// offload, and every component is on a known device.
#[test]
fn hard_10gb_card_stops_with_group_offload_advice() {
    let card = CardSpec::parse("10GB").unwrap().with_mode(Mode::Hard);
    let run = simulate(&PipelineProfile::z_image_turbo(4), card, &RunOptions::default()).unwrap();
    let error = run.error.clone().unwrap();
    assert!(error.contains("transformer") && error.contains("group offloading"), "{error}");
    assert_eq!(run.completed, 1);
    let oom: Vec<&OffloadEvent> = run.events.iter().filter(|e| e.action == Action::Offload).collect();
    assert!(oom.iter().all(|e| e.id.starts_with("text_encoder")), "{}", run.record);
}

/// Hard mode on a card where everything fits is the same as soft mode.
#[test]
fn hard_and_soft_agree_where_nothing_runs_out() {
    let soft = run("32GB");
    let card = CardSpec::parse("32GB").unwrap().with_mode(Mode::Hard);
    let hard = simulate(&PipelineProfile::z_image_turbo(4), card, &RunOptions::default()).unwrap();
    assert_eq!(soft.events, hard.events);
}

#[test]
fn impossible_reserves_are_errors() {
    let options = RunOptions { reserve: 40_000_000_000, ..RunOptions::default() };
    let err = simulate(&PipelineProfile::z_image_turbo(4), CardSpec::parse("32GB").unwrap(), &options).unwrap_err();
    assert!(matches!(err, memory_sim::SimError::ImpossibleCard { .. }), "{err}");
}

/// The offline optimum is a lower bound: no strategy that keeps the reserve moves fewer bytes.
#[test]
fn no_strategy_beats_the_optimum() {
    use offload_strategy::{Auto, Lookahead, Sequential};
    use std::sync::Arc;
    let profile = PipelineProfile::z_image_turbo(4);
    for card in ["10GB", "16GB", "20GB", "24GB", "32GB", "rtx4090"] {
        for prompts in [1, 4] {
            let uses = profile.uses(prompts);
            let strategies: Vec<Arc<dyn offload_strategy::OffloadStrategy>> =
                vec![Arc::new(Auto), Arc::new(Sequential), Arc::new(Lookahead::new(uses))];
            for strategy in strategies {
                let name = strategy.name().to_string();
                let options = RunOptions { prompts, strategy: Some(strategy), ..RunOptions::default() };
                let run = simulate(&profile, CardSpec::parse(card).unwrap(), &options).unwrap();
                let optimum = run.optimum.unwrap().total();
                assert!(run.moved() >= optimum, "{card} x{prompts} {name}: moved {} < optimum {optimum}", run.moved());
            }
        }
    }
}
