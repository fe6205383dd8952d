//! Phase-staged execution with a fake release hook: order, timing, and fallible phases.

use std::cell::RefCell;

use offload_core::plan::Phases;

#[test]
fn the_hook_runs_between_phases_in_order() {
    let log = RefCell::new(Vec::new());
    let mut phases = Phases::new(|finished: &str| log.borrow_mut().push(format!("release after {finished}")));
    let embeddings = phases.run("encode", || {
        log.borrow_mut().push("encode".to_string());
        vec![0.5_f32; 4]
    });
    let latents = phases.run("denoise", || {
        log.borrow_mut().push("denoise".to_string());
        embeddings.iter().sum::<f32>()
    });
    let image = phases.run("decode", || {
        log.borrow_mut().push("decode".to_string());
        latents * 2.0
    });
    let report = phases.finish();
    assert_eq!(image, 4.0);
    assert_eq!(
        log.into_inner(),
        ["encode", "release after encode", "denoise", "release after denoise", "decode"],
        "released between phases, never after the last"
    );
    let names: Vec<&str> = report.phases.iter().map(|p| p.name.as_str()).collect();
    assert_eq!(names, ["encode", "denoise", "decode"]);
    assert!(report.phases.iter().all(|p| p.seconds >= 0.0 && p.release_seconds >= 0.0));
    assert_eq!(report.phase("decode").map(|p| p.release_seconds), Some(0.0));
}

#[test]
fn phases_and_releases_are_timed() {
    let pause = std::time::Duration::from_millis(20);
    let mut phases = Phases::new(|_: &str| std::thread::sleep(pause));
    phases.run("encode", || std::thread::sleep(pause));
    phases.run("denoise", || ());
    let report = phases.finish();
    let encode = report.phase("encode").expect("ran");
    assert!(encode.seconds >= 0.02, "{encode:?}");
    assert!(encode.release_seconds >= 0.02, "{encode:?}");
    assert!(report.total_seconds() >= 0.04);
    let text = report.to_string();
    assert!(text.lines().count() == 3 && text.starts_with("encode ") && text.contains("total"), "{text}");
}

#[test]
fn a_failed_phase_returns_its_error_and_the_next_phase_still_starts_clean() {
    let released = RefCell::new(0);
    let mut phases = Phases::new(|_: &str| *released.borrow_mut() += 1);
    let failed: Result<(), String> = phases.run("encode", || Err("out of memory".to_string()));
    assert_eq!(failed, Err("out of memory".to_string()));
    // A retry of the phase (say, after re-planning) begins after a release.
    let retried: Result<u32, String> = phases.run("encode", || Ok(1));
    assert_eq!(retried, Ok(1));
    assert_eq!(*released.borrow(), 1);
    assert_eq!(phases.timings().len(), 2);
}
