//! The rule both example models count their offload-specific lines by, shared by their tests: non-blank lines
//! between `// offload: begin` and `// offload: end`, plus every other code line holding an accessor that a
//! resident-only forward would not need (it would read the field directly).

/// The accessors: each line holding one exists only for offloading.
pub const ACCESSORS: [&str; 6] = ["leaf!(", "narrow!(", ".own()", ".shell.", ".structure()", "#[offload("];

/// `(marked, accessors)` in `source`; panics when a marked region is not closed (a test's failure).
pub fn count(source: &str) -> (usize, usize) {
    let mut inside = false;
    let (mut marked, mut accessors) = (0, 0);
    for line in source.lines().map(str::trim) {
        match line {
            _ if line.starts_with("// offload: begin") => inside = true,
            "// offload: end" => inside = false,
            "" => {}
            _ if inside => marked += 1,
            _ if line.starts_with("//") => {}
            _ if ACCESSORS.iter().any(|accessor| line.contains(accessor)) => accessors += 1,
            _ => {}
        }
    }
    assert!(!inside, "an offload region is not closed");
    (marked, accessors)
}
