//! Phase-staged execution: named phases (encode, denoise, decode) timed one by one, with a release hook run
//! between them so each phase starts with the memory the previous one left behind given back.
//!
//! The hook is the caller's: the pipeline passes one that drops its caches and calls burn's
//! `device.memory_cleanup()`. This module only orders and times; it knows no device.

use std::fmt;
use std::time::Instant;

/// How long one phase took, and how long the release after it took.
#[derive(Debug, Clone, PartialEq)]
pub struct PhaseTiming {
    /// The phase's name.
    pub name: String,
    /// Seconds the phase ran.
    pub seconds: f64,
    /// Seconds the release hook ran after it; 0 for the last phase, which nothing follows.
    pub release_seconds: f64,
}

/// Runs named phases in order, timing each, and calls `release` with the finished phase's name between two
/// phases.
///
/// ```
/// use offload_core::plan::Phases;
/// let mut released = Vec::new();
/// let mut phases = Phases::new(|finished: &str| released.push(finished.to_string()));
/// let embeddings = phases.run("encode", || vec![1.0_f32; 4]);
/// let latents = phases.run("denoise", || embeddings.iter().sum::<f32>());
/// let image = phases.run("decode", || latents * 2.0);
/// let report = phases.finish();
/// assert_eq!(image, 8.0);
/// assert_eq!(report.phases.len(), 3);
/// assert_eq!(released, ["encode", "denoise"]);
/// ```
pub struct Phases<R: FnMut(&str)> {
    release: R,
    timings: Vec<PhaseTiming>,
}

impl<R: FnMut(&str)> Phases<R> {
    /// Phases whose memory is released by `release`, called with the name of the phase that just finished.
    pub fn new(release: R) -> Self {
        Self { release, timings: Vec::new() }
    }

    /// Runs one phase: first the release after the previous phase, if any, then `phase`, timed. A fallible
    /// phase returns its `Result` through; what it left is still released before the next phase.
    pub fn run<T>(&mut self, name: &str, phase: impl FnOnce() -> T) -> T {
        if let Some(previous) = self.timings.last_mut() {
            let start = Instant::now();
            (self.release)(&previous.name);
            previous.release_seconds = start.elapsed().as_secs_f64();
        }
        let start = Instant::now();
        let out = phase();
        let seconds = start.elapsed().as_secs_f64();
        tracing::debug!(phase = name, seconds, "phase finished");
        self.timings.push(PhaseTiming { name: name.to_string(), seconds, release_seconds: 0.0 });
        out
    }

    /// The phases run so far.
    pub fn timings(&self) -> &[PhaseTiming] {
        &self.timings
    }

    /// Ends the run and returns the timings. The last phase is not followed by a release; call the hook
    /// yourself if the process goes on to other work.
    pub fn finish(self) -> PhaseReport {
        PhaseReport { phases: self.timings }
    }
}

/// The timings of a phase-staged run.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct PhaseReport {
    /// Each phase, in order.
    pub phases: Vec<PhaseTiming>,
}

impl PhaseReport {
    /// Seconds of all phases and releases.
    pub fn total_seconds(&self) -> f64 {
        self.phases.iter().map(|p| p.seconds + p.release_seconds).sum()
    }

    /// A phase by name.
    pub fn phase(&self, name: &str) -> Option<&PhaseTiming> {
        self.phases.iter().find(|p| p.name == name)
    }
}

impl fmt::Display for PhaseReport {
    /// One line per phase, `encode   1.234 s (release 0.010 s)`, and the total.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let width = self.phases.iter().map(|p| p.name.len()).max().unwrap_or(0).max(5);
        for phase in &self.phases {
            writeln!(f, "{:<width$}  {:>8.3} s (release {:.3} s)", phase.name, phase.seconds, phase.release_seconds)?;
        }
        write!(f, "{:<width$}  {:>8.3} s", "total", self.total_seconds())
    }
}
