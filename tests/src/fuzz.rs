//! A mutation fuzzer: seeds, random mutations, a target that must never panic.
//!
//! Each execution takes a seed (or a previous input), applies one to four mutations (flip, insert, delete or
//! replace a byte; splice two inputs; duplicate a slice; insert an interesting token such as a unit, a digit
//! run, a quote or a brace), and calls the target under `catch_unwind`. A panic is a crash: the input is kept
//! in the report. The generator is a seeded xorshift, so a run is reproducible from its seed.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::time::{Duration, Instant};

/// What a fuzzing run did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FuzzReport {
    /// The target's name.
    pub target: String,
    /// Inputs executed.
    pub executions: u64,
    /// Inputs that made the target panic (at most the first 16).
    pub crashes: Vec<Vec<u8>>,
    /// How long it took.
    pub elapsed: Duration,
}

impl std::fmt::Display for FuzzReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}: {} executions in {:.1} s ({:.0}/s), {} crash(es)",
            self.target,
            self.executions,
            self.elapsed.as_secs_f64(),
            self.executions as f64 / self.elapsed.as_secs_f64().max(1e-9),
            self.crashes.len()
        )
    }
}

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn below(&mut self, n: usize) -> usize {
        if n == 0 { 0 } else { (self.next() % n as u64) as usize }
    }
}

const TOKENS: &[&[u8]] = &[
    b"GB",
    b"GiB",
    b"gib",
    b"MB",
    b"KiB",
    b"TB",
    b"B",
    b".",
    b"-",
    b"+",
    b" ",
    b"0",
    b"9",
    b"18446744073709551615",
    b"99999999999999999999999",
    b"e10",
    b"NaN",
    b"inf",
    b"\"",
    b"{",
    b"}",
    b"[",
    b"]",
    b":",
    b",",
    b"null",
    b"true",
    b"\\u0000",
    b"\xff",
    b"\xc3\xa9",
    b"=",
    b"\n",
    b"#",
];

fn mutate(rng: &mut Rng, input: &mut Vec<u8>, pool: &[Vec<u8>]) {
    for _ in 0..=rng.below(4) {
        match rng.below(7) {
            0 if !input.is_empty() => {
                let i = rng.below(input.len());
                input[i] ^= 1 << rng.below(8);
            }
            1 => {
                let i = rng.below(input.len() + 1);
                input.insert(i, rng.next() as u8);
            }
            2 if !input.is_empty() => {
                let i = rng.below(input.len());
                input.remove(i);
            }
            3 if !input.is_empty() => {
                let i = rng.below(input.len());
                input[i] = rng.next() as u8;
            }
            4 if !pool.is_empty() => {
                let other = &pool[rng.below(pool.len())];
                let cut = rng.below(input.len() + 1);
                let from = rng.below(other.len() + 1);
                input.truncate(cut);
                input.extend_from_slice(&other[from..]);
            }
            5 if !input.is_empty() && input.len() < 4096 => {
                let start = rng.below(input.len());
                let end = start + rng.below(input.len() - start + 1);
                let slice = input[start..end].to_vec();
                let at = rng.below(input.len() + 1);
                input.splice(at..at, slice);
            }
            _ => {
                let token = TOKENS[rng.below(TOKENS.len())];
                let at = rng.below(input.len() + 1);
                input.splice(at..at, token.iter().copied());
            }
        }
    }
}

/// Runs `target` on `executions` mutated inputs grown from `seeds`, with a reproducible `seed`.
///
/// Panics inside the target are caught and reported; the default panic message is silenced for the run.
pub fn fuzz(name: &str, seeds: &[Vec<u8>], executions: u64, seed: u64, target: impl Fn(&[u8])) -> FuzzReport {
    let started = Instant::now();
    let mut rng = Rng(seed | 1);
    let mut pool: Vec<Vec<u8>> = if seeds.is_empty() { vec![Vec::new()] } else { seeds.to_vec() };
    let mut crashes = Vec::new();
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    for n in 0..executions {
        let mut input = pool[rng.below(pool.len())].clone();
        mutate(&mut rng, &mut input, &pool);
        if catch_unwind(AssertUnwindSafe(|| target(&input))).is_err() && crashes.len() < 16 {
            crashes.push(input.clone());
        }
        // Keep a bounded pool of recent inputs so mutations compound.
        if n % 7 == 0 && input.len() < 1 << 16 {
            if pool.len() < 256 {
                pool.push(input);
            } else {
                let i = rng.below(pool.len() - seeds.len().min(pool.len() - 1)) + seeds.len().min(pool.len() - 1);
                pool[i] = input;
            }
        }
    }
    std::panic::set_hook(hook);
    FuzzReport { target: name.to_string(), executions, crashes, elapsed: started.elapsed() }
}

/// Reads the seed corpus of a target: every file in `dir`.
pub fn corpus(dir: &std::path::Path) -> Vec<Vec<u8>> {
    let mut files: Vec<_> = std::fs::read_dir(dir).map(|d| d.flatten().map(|e| e.path()).collect()).unwrap_or_default();
    files.sort();
    files.iter().filter_map(|p| std::fs::read(p).ok()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_a_planted_crash_and_counts_executions() {
        let report = fuzz("planted", &[b"abc".to_vec()], 20_000, 7, |input| {
            if input.windows(2).any(|w| w == b"GB") {
                panic!("planted");
            }
        });
        assert_eq!(report.executions, 20_000);
        assert!(!report.crashes.is_empty());
        assert!(report.crashes.iter().all(|c| c.windows(2).any(|w| w == b"GB")));
    }

    #[test]
    fn a_robust_target_reports_no_crash() {
        let report = fuzz("len", &[b"x".to_vec()], 5_000, 1, |input| {
            let _ = input.len();
        });
        assert!(report.crashes.is_empty());
    }
}
