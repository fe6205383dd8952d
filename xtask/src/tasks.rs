//! Commands that run other programs: benchmarks that need burn, and the Python fixture generator.

use std::path::PathBuf;
use std::process::Command;

use anyhow::{Context, bail};

/// Arguments of `cargo xtask bench`.
#[derive(clap::Args)]
pub struct BenchArgs {
    /// Which benchmark: `overlap`, `offload [--device wgpu]` (offload overhead against resident on one runtime),
    /// or `real-size --weights DIR` (a checkpoint from `cargo xtask fixtures --real-size DIR`).
    pub name: String,
    /// Extra arguments passed to the benchmark program.
    #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
    pub rest: Vec<String>,
}

/// Arguments of `cargo xtask fixtures`.
#[derive(clap::Args)]
pub struct FixturesArgs {
    /// The Python interpreter with diffusers 0.42.1, transformers and torch installed; without them, the
    /// workspace's `.venv` is created from `tools/requirements-fixtures.txt` and used instead.
    #[arg(long, default_value = "python3")]
    pub python: String,
    /// Write a Z-Image-Turbo checkpoint at its real size with random bf16 weights here instead (about 20.6 GB;
    /// not committed), with `tools/make_real_size.py`.
    #[arg(long, value_name = "DIR")]
    pub real_size: Option<PathBuf>,
    /// Write into a non-empty directory the generators did not make, beside its files: a generator never writes
    /// over or removes a file it did not write (its manifest lists its own), and a directory holding a file where
    /// it writes, such as a downloaded checkpoint's shards, configs or tokenizer, is refused even with --force.
    #[arg(long)]
    pub force: bool,
}

fn workspace_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).parent().map(PathBuf::from).unwrap_or_default()
}

pub(crate) fn status(mut command: Command, what: &str) -> anyhow::Result<()> {
    let status = command.current_dir(workspace_root()).status().with_context(|| format!("cannot start {what}"))?;
    if !status.success() {
        bail!("{what} failed with {status}");
    }
    Ok(())
}

/// Runs a benchmark program.
pub fn bench(args: &BenchArgs) -> anyhow::Result<()> {
    match args.name.as_str() {
        "overlap" => {
            let mut command = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
            command.args(["run", "--quiet", "-p", "group-offload", "--example", "overlap", "--"]).args(&args.rest);
            status(command, "the overlap benchmark")
        }
        "offload" => {
            // The wgpu runtime needs the crate's wgpu feature; the CPU run needs nothing.
            let wgpu = args.rest.windows(2).any(|w| w[0] == "--device" && w[1].starts_with("wgpu"));
            let mut rest = args.rest.clone();
            // lavapipe reports no device size to the default (WGSL) build: a size it holds, unless one is given.
            if wgpu && !rest.iter().any(|a| a == "--device-memory") {
                rest.extend(["--device-memory".to_string(), "2GiB".to_string()]);
            }
            let mut command = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
            command.args(["run", "--quiet", "-p", "pipeline-zimage"]);
            if wgpu {
                command.args(["--features", "wgpu"]);
            }
            command.args(["--example", "offload_overhead", "--"]).args(&rest);
            status(command, "the offload overhead benchmark")
        }
        "real-size" => real_size(&args.rest),
        other => bail!("unknown benchmark {other:?}; the benchmarks are: overlap, offload, real-size"),
    }
}

/// The Python packages the generators import; an interpreter without them gets the pinned environment.
const FIXTURE_IMPORTS: &str = "import torch, diffusers, transformers, safetensors, peft";

/// Whether `python` imports every package the generators need.
fn has_fixture_packages(python: &std::path::Path) -> bool {
    Command::new(python)
        .args(["-c", FIXTURE_IMPORTS])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok_and(|status| status.success())
}

/// The interpreter the generators run with: `python` when it has torch, diffusers and transformers, otherwise the
/// workspace's own environment `.venv` (gitignored), created from `tools/requirements-fixtures.txt` (the versions
/// the goldens were made with) the first time it is needed and reused after.
fn fixture_python(python: &str) -> anyhow::Result<PathBuf> {
    let given = PathBuf::from(python);
    if has_fixture_packages(&given) {
        return Ok(given);
    }
    let root = workspace_root();
    let venv = root.join(".venv");
    let venv_python = venv.join("bin").join("python");
    if has_fixture_packages(&venv_python) {
        return Ok(venv_python);
    }
    println!(
        "{python} lacks torch, diffusers or transformers: creating {} from tools/requirements-fixtures.txt",
        venv.display()
    );
    if !venv_python.exists() {
        let mut command = Command::new(python);
        command.args(["-m", "venv"]).arg(&venv);
        status(command, "python -m venv .venv (install python3-venv)")?;
    }
    let mut command = Command::new(venv.join("bin").join("pip"));
    command.args(["install", "-r", "tools/requirements-fixtures.txt"]);
    status(command, "pip install -r tools/requirements-fixtures.txt into .venv")?;
    if !has_fixture_packages(&venv_python) {
        bail!("{} still cannot import torch, diffusers and transformers after the install", venv_python.display());
    }
    Ok(venv_python)
}

/// Regenerates the fixtures with the reference implementation.
pub fn fixtures(args: &FixturesArgs) -> anyhow::Result<()> {
    let python = fixture_python(&args.python)?;
    if let Some(dir) = &args.real_size {
        // The generator runs from the workspace root; a relative DIR is the user's, from where they ran it.
        let dir = std::path::absolute(dir).with_context(|| format!("cannot resolve {}", dir.display()))?;
        let mut command = Command::new(&python);
        command.arg("tools/make_real_size.py").arg("--out").arg(&dir);
        if args.force {
            command.arg("--force");
        }
        return status(command, "tools/make_real_size.py (install tools/requirements-fixtures.txt first)");
    }
    let mut command = Command::new(&python);
    command.args(["tools/make_fixtures.py", "--out", "crates/pipeline-zimage/tests/fixtures"]);
    if args.force {
        command.arg("--force");
    }
    status(command, "tools/make_fixtures.py (install tools/requirements-fixtures.txt first)")?;
    // The variants are overlays on the tiny checkpoint just written.
    let mut command = Command::new(&python);
    command.args(["tools/make_variant_fixtures.py", "--fixtures", "crates/pipeline-zimage/tests/fixtures"]);
    if args.force {
        command.arg("--force");
    }
    status(command, "tools/make_variant_fixtures.py (install tools/requirements-fixtures.txt first)")?;
    // The LoRA files and their goldens, for the tiny checkpoint just written.
    let mut command = Command::new(&python);
    command.args(["tools/make_lora_fixtures.py", "--fixtures", "crates/pipeline-zimage/tests/fixtures"]);
    if args.force {
        command.arg("--force");
    }
    status(command, "tools/make_lora_fixtures.py (install tools/requirements-fixtures.txt first)")
}

/// The LLVM release burn 0.22.1's CUDA backend builds against (cubecl-cuda 0.11 → tracel-llvm-bundler).
const TRACEL_LLVM: &str = "tracel-llvm-23.1.0-4";
/// The static LLVM 23.1 with `llvm-config` and the NVPTX target, from the Python registry.
const LLVM_WHEELS: &[&str] = &["mlc-llvm-static==23.1.1.post0", "mlc-llvm-static-extra-targets==23.1.1.post0"];

/// Arguments of `cargo xtask setup-cuda`.
#[derive(clap::Args)]
pub struct SetupCudaArgs {
    /// The Python interpreter whose pip downloads the wheels (it also runs `llvm-config`, a Python script).
    #[arg(long, default_value = "python3")]
    pub python: String,
    /// Install here instead of the platform's local data directory (for tests).
    #[arg(long)]
    pub into: Option<PathBuf>,
}

/// Installs the LLVM bundle that burn's `cuda` feature needs, without the bundler's download.
///
/// burn 0.22.1's `cuda` feature builds cubecl-cuda 0.11, whose `tracel-llvm-bundler` build script downloads an
/// LLVM 23 archive unless `<local data dir>/tracel/tracel-llvm-23.1.0-4/.tracel-llvm-installed` exists. This
/// command downloads the static LLVM 23.1 SDK from the Python registry instead (two wheels: the base SDK and
/// the extra targets with NVPTX), merges their `static/` trees into that directory and writes the sentinel.
pub fn setup_cuda(args: &SetupCudaArgs) -> anyhow::Result<()> {
    let target = match &args.into {
        Some(dir) => dir.clone(),
        None => dirs::data_local_dir()
            .context("this platform has no local data directory; pass --into DIR")?
            .join("tracel")
            .join(TRACEL_LLVM),
    };
    let sentinel = target.join(".tracel-llvm-installed");
    if sentinel.exists() {
        println!("LLVM for burn's cuda feature is already installed in {}", target.display());
        return Ok(());
    }
    let scratch = std::env::temp_dir().join(format!("xtask-setup-cuda-{}", std::process::id()));
    std::fs::create_dir_all(&scratch)?;
    let mut download = Command::new(&args.python);
    download.args(["-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d"]).arg(&scratch).args(LLVM_WHEELS);
    status(download, "pip download of the LLVM wheels")?;
    let unpacked = scratch.join("unpacked");
    for entry in std::fs::read_dir(&scratch)? {
        let wheel = entry?.path();
        if wheel.extension().is_some_and(|e| e == "whl") {
            let mut unzip = Command::new(&args.python);
            unzip.args(["-m", "zipfile", "-e"]).arg(&wheel).arg(&unpacked);
            status(unzip, "unpacking a wheel")?;
        }
    }
    let sdk = unpacked.join("mlc_llvm_static").join("static");
    if !sdk.join("bin").join("llvm-config").exists() {
        bail!(
            "the wheels did not contain mlc_llvm_static/static/bin/llvm-config; check the pinned versions {LLVM_WHEELS:?}"
        );
    }
    copy_tree(&sdk, &target)?;
    make_executable(&target.join("bin"))?;
    std::fs::write(&sentinel, "installed by cargo xtask setup-cuda from mlc-llvm-static 23.1.1.post0\n")?;
    std::fs::remove_dir_all(&scratch).ok();
    println!("installed LLVM 23.1 for burn's cuda feature in {}", target.display());
    println!("now: cargo build -p pipeline-zimage --features cuda");
    Ok(())
}

fn copy_tree(from: &std::path::Path, to: &std::path::Path) -> anyhow::Result<()> {
    std::fs::create_dir_all(to)?;
    for entry in std::fs::read_dir(from)? {
        let entry = entry?;
        let destination = to.join(entry.file_name());
        if entry.file_type()?.is_dir() {
            copy_tree(&entry.path(), &destination)?;
        } else {
            std::fs::copy(entry.path(), &destination)
                .with_context(|| format!("copying to {}", destination.display()))?;
        }
    }
    Ok(())
}

fn make_executable(bin: &std::path::Path) -> anyhow::Result<()> {
    #[cfg(unix)]
    for entry in std::fs::read_dir(bin)? {
        use std::os::unix::fs::PermissionsExt;
        let path = entry?.path();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755))?;
    }
    Ok(())
}

/// `cargo xtask bench real-size --weights DIR [generate arguments]`: the CLI on a real-size checkpoint on the CPU
/// (bf16, 256x256, 1 step, release build) with its memory report, three times side by side: the RAM tier (every
/// host copy in RAM: `--set host_tier=ram`, the whole model loaded first, as before the file tier), then twice the
/// host budget's run (`--preset low_ram_safe --ram 4GB` on a simulated 8 GB card: the copies read from their
/// checkpoint files; the second run's page cache is as warm as the machine's RAM leaves it). Per run and phase: the
/// wall time, the anonymous peak beside the card's peak plus 2.0 GB (the host budget's goal), the time to the first
/// denoising step; then the file tier's seconds per step over the RAM tier's (goal: at most 1.10). `--single` runs
/// the given arguments once instead (the report of one run).
fn real_size(rest: &[String]) -> anyhow::Result<()> {
    let has = |flag: &str| rest.iter().any(|a| a == flag);
    if !has("--weights") {
        bail!("pass --weights DIR: a real-size checkpoint (make one with `cargo xtask fixtures --real-size DIR`)");
    }
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    // Built first, so the timed runs are the generation alone and the release profile's, as a user runs it.
    let mut build = Command::new(&cargo);
    build.args(["build", "--release", "--quiet", "-p", "pipeline-zimage"]);
    status(build, "cargo build --release -p pipeline-zimage")?;
    let rest: Vec<String> = rest.iter().filter(|a| *a != "--single").cloned().collect();
    if has("--single") {
        let (stdout, wall) =
            generate_real_size(&cargo, &with_defaults(&rest, &[("--card", "16GB"), ("--preset", "auto")]))?;
        print!("{}", real_size_report(&stdout, wall)?);
        return Ok(());
    }
    let budget = [("--card", "8GB"), ("--preset", "low_ram_safe")];
    let mut ram_args = with_defaults(&rest, &budget);
    ram_args.extend(["--set".to_string(), "host_tier=ram".to_string()]);
    let mut file_args = with_defaults(&rest, &budget);
    if !has("--ram") {
        file_args.extend(["--ram".to_string(), "4GB".to_string()]);
    }
    let mut runs = Vec::new();
    for (name, args) in [("ram tier", &ram_args), ("file tier, 1st", &file_args), ("file tier, 2nd", &file_args)] {
        println!("running the {name}: pipeline-zimage {}", args.join(" "));
        let (stdout, wall) = generate_real_size(&cargo, args)?;
        runs.push((name, HostBudgetRun::read(&stdout, wall)?));
    }
    print!("{}", host_budget_report(&runs));
    Ok(())
}

/// `generate --memory-report` with `rest`, and each of `defaults` the arguments do not set; 256x256, 1 step.
fn with_defaults(rest: &[String], defaults: &[(&str, &str)]) -> Vec<String> {
    let has = |flag: &str| rest.iter().any(|a| a == flag);
    let mut args: Vec<String> = vec!["generate".into(), "--memory-report".into()];
    for (flag, value) in [("--height", "256"), ("--width", "256"), ("--steps", "1")].iter().chain(defaults) {
        if !has(flag) {
            args.extend([flag.to_string(), value.to_string()]);
        }
    }
    if !has("--out") {
        args.extend(["--out".to_string(), std::env::temp_dir().join("real-size.png").display().to_string()]);
    }
    args.extend(rest.iter().cloned());
    args
}

/// Runs the release CLI with `args`: its standard output and its wall time.
fn generate_real_size(cargo: &str, args: &[String]) -> anyhow::Result<(String, f64)> {
    let started = std::time::Instant::now();
    let output = Command::new(cargo)
        .args(["run", "--release", "--quiet", "-p", "pipeline-zimage", "--"])
        .args(args)
        .current_dir(workspace_root())
        .output()
        .context("cannot start pipeline-zimage")?;
    let wall = started.elapsed().as_secs_f64();
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    if !output.status.success() {
        bail!("pipeline-zimage failed with {}:\n{stdout}\n{}", output.status, String::from_utf8_lossy(&output.stderr));
    }
    Ok((stdout, wall))
}

/// The host budget's goal: in every phase, the anonymous memory at most the card's peak in use plus this many
/// bytes (the peers: 2.36 GB for ComfyUI's `--fast-disk`, 2.81 GB for diffusers' group offload to disk).
const HOST_BUDGET_BEYOND_CARD: u64 = 2_000_000_000;

/// The file tier's seconds per denoising step over the RAM tier's, at most.
const GOAL_FILE_OVER_RAM: f64 = 1.10;

/// One real-size run as its `--memory-report` lines tell it.
#[derive(Debug, Clone, PartialEq)]
struct HostBudgetRun {
    /// Per phase (`load`, `encode`, `denoise`, `decode`): the anonymous peak and the card's peak in use.
    phases: Vec<(String, u64, u64)>,
    /// The weights' bytes.
    weights: u64,
    /// Seconds from the start of the run to its first denoising step.
    first_step: f64,
    /// The denoising phase's seconds, and its steps.
    denoise: f64,
    /// The whole run's wall time, the process's start included.
    wall: f64,
}

impl HostBudgetRun {
    fn read(stdout: &str, wall: f64) -> anyhow::Result<Self> {
        let field = |line: &str, key: &str| -> Option<String> {
            line.split_whitespace().find_map(|word| word.strip_prefix(&format!("{key}=")).map(str::to_string))
        };
        let mut phases = Vec::new();
        let mut weights = 0;
        for line in stdout.lines().filter(|l| l.starts_with("host_budget ")) {
            let number = |key: &str| {
                field(line, key).and_then(|v| v.parse::<u64>().ok()).with_context(|| format!("{key} in {line:?}"))
            };
            weights = number("weights")?;
            phases.push((field(line, "phase").context("phase")?, number("anonymous_peak")?, number("card_peak")?));
        }
        if phases.is_empty() {
            bail!("no host_budget lines in the CLI's output (run with --memory-report)");
        }
        let first_step = stdout
            .lines()
            .find_map(|l| l.strip_prefix("time_to_first_step seconds="))
            .and_then(|v| v.trim().parse().ok())
            .context("no time_to_first_step line")?;
        let denoise = stdout
            .lines()
            .skip_while(|l| !l.starts_with("phases:"))
            .find_map(|l| l.strip_prefix("denoise"))
            .and_then(|rest| rest.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .context("no denoise phase time")?;
        Ok(Self { phases, weights, first_step, denoise, wall })
    }

    /// Whether every phase held at most the card's peak plus [`HOST_BUDGET_BEYOND_CARD`].
    fn within_budget(&self) -> bool {
        self.phases.iter().all(|(_, anonymous, card)| *anonymous <= card + HOST_BUDGET_BEYOND_CARD)
    }
}

/// The runs side by side: per run and phase the anonymous peak against the card's peak plus 2.0 GB, the time to the
/// first step and the denoising time; then the file tier's denoising over the RAM tier's and the time to the first
/// step of each.
fn host_budget_report(runs: &[(&str, HostBudgetRun)]) -> String {
    let gb = |bytes: u64| bytes as f64 / 1e9;
    let mut out =
        String::from("run              phase     anonymous peak   card peak   card + 2.0 GB   within   (GB)\n");
    for (name, run) in runs {
        for (phase, anonymous, card) in &run.phases {
            let budget = card + HOST_BUDGET_BEYOND_CARD;
            out.push_str(&format!(
                "{name:<16} {phase:<8} {:>15.2} {:>11.2} {:>15.2}   {}\n",
                gb(*anonymous),
                gb(*card),
                gb(budget),
                if *anonymous <= budget { "yes" } else { "no" }
            ));
        }
    }
    out.push_str("\nrun              first step (s)   denoise (s)   whole run (s)   within the budget\n");
    for (name, run) in runs {
        out.push_str(&format!(
            "{name:<16} {:>14.1} {:>13.1} {:>15.1}   {}\n",
            run.first_step,
            run.denoise,
            run.wall,
            if run.within_budget() { "every phase" } else { "no" }
        ));
    }
    let ram = runs.iter().find(|(name, _)| name.starts_with("ram"));
    let file = runs.iter().rev().find(|(name, _)| name.starts_with("file"));
    if let (Some((_, ram)), Some((_, file))) = (ram, file) {
        let ratio = file.denoise / ram.denoise.max(f64::MIN_POSITIVE);
        out.push_str(&format!(
            "\nweights {:.2} GB; the file tier's denoising step (last run) over the RAM tier's: {ratio:.3} (goal <= \
             {GOAL_FILE_OVER_RAM}: {}); time to the first denoising step: file {:.1} s, RAM (the whole model loaded \
             first) {:.1} s\n",
            gb(file.weights),
            if ratio <= GOAL_FILE_OVER_RAM { "met" } else { "missed" },
            file.first_step,
            ram.first_step
        ));
    }
    out
}

/// The host-memory goal of a real-size run: its peak at most this many times the weights, plus the largest
/// activation estimate.
const GOAL_HOST_PEAK_OVER_WEIGHTS: f64 = 1.1;

/// The benchmark's table from the CLI's output (`memory:` lines, the `phases:` block, the reserve line).
fn real_size_report(stdout: &str, wall: f64) -> anyhow::Result<String> {
    let number = |line: &str, after: &str| -> Option<u64> {
        let rest = line.split(after).nth(1)?;
        rest.trim().split(' ').next()?.parse().ok()
    };
    let mut out = String::new();
    let mut weights = None;
    let mut peaks: Vec<(String, u64, u64)> = Vec::new();
    for line in stdout.lines() {
        if let Some(rest) = line.strip_prefix("memory: loaded ") {
            out.push_str(&format!("loaded {rest}\n"));
        } else if line.starts_with("memory: weights ") {
            weights = number(line, "memory: weights ");
            let loading = number(line, "host peak while loading ").context("the loading peak")?;
            peaks.push(("load".into(), loading, number(line, "anonymous ").context("the anonymous peak")?));
        } else if let Some(rest) = line.strip_prefix("memory: host peak during ") {
            let (phase, after) = rest.split_once(':').context("a phase")?;
            let peak = after.split_whitespace().next().and_then(|n| n.parse().ok()).context("a phase peak")?;
            peaks.push((phase.to_string(), peak, number(line, "anonymous ").context("the anonymous peak")?));
        }
    }
    let weights = weights.context("no memory report in the CLI's output")?;
    let activation = stdout
        .lines()
        .find(|line| line.starts_with("reserve: "))
        .and_then(|line| line.split('(').next())
        .map(|size| size.trim_start_matches("reserve: ").trim().to_string());
    let times: Vec<(String, String)> = stdout
        .lines()
        .skip_while(|line| !line.starts_with("phases:"))
        .skip(1)
        .take_while(|line| !line.trim().is_empty())
        .filter_map(|line| {
            let mut parts = line.split_whitespace();
            Some((parts.next()?.to_string(), parts.next()?.to_string()))
        })
        .collect();
    out.push_str("phase      wall (s)   resident peak   x weights   anonymous peak   x weights\n");
    for (phase, peak, anonymous) in &peaks {
        let time = times.iter().find(|(name, _)| name == phase).map_or("-", |(_, t)| t.as_str());
        let (r, a) = (*peak as f64 / weights as f64, *anonymous as f64 / weights as f64);
        out.push_str(&format!("{phase:<10} {time:>8}   {peak:>13}   {r:>9.3}   {anonymous:>14}   {a:>9.3}\n"));
    }
    let worst = peaks.iter().map(|(_, peak, _)| *peak).max().unwrap_or(0);
    let worst_anonymous = peaks.iter().map(|(_, _, anonymous)| *anonymous).max().unwrap_or(0);
    out.push_str(&format!(
        "weights {weights} bytes; worst resident peak {:.3} x the weights (it counts the mapped pages of the shard \
         being read), worst anonymous peak {:.3} x; largest activation estimate {}; whole run {wall:.1} s (the \
         loading and the process start included)\n",
        worst as f64 / weights as f64,
        worst_anonymous as f64 / weights as f64,
        activation.clone().unwrap_or_else(|| "not printed".into())
    ));
    // The goal: the host holds the weights once, with a tenth for everything else, plus the largest activation.
    // The CLI prints binary sizes labelled KB/MB/GB (the anchor's record format): read them as binary.
    let binary = |size: &str| size.replace(" KB", "KiB").replace(" MB", "MiB").replace(" GB", "GiB");
    let activation_bytes =
        activation.as_deref().and_then(|size| offload_core::parse_size(&binary(size)).ok()).unwrap_or(0);
    let goal = (weights as f64 * GOAL_HOST_PEAK_OVER_WEIGHTS) as u64 + activation_bytes;
    out.push_str(&format!(
        "goal: host peak <= {GOAL_HOST_PEAK_OVER_WEIGHTS} x the weights + the largest activation = {goal} bytes: \
         resident {} ({:.3} of the goal), anonymous {} ({:.3} of the goal)\n",
        if worst <= goal { "met" } else { "missed" },
        worst as f64 / goal as f64,
        if worst_anonymous <= goal { "met" } else { "missed" },
        worst_anonymous as f64 / goal as f64,
    ));
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The lines of a real run the report reads (from a 20.3 GB checkpoint, 2026-12-01; the anonymous figures
    /// rounded), among others it skips.
    const RUN: &str = "\
memory: loaded text_encoder: 7843069440 bytes (7.30 GB)
memory: loaded transformer: 12309817472 bytes (11.46 GB)
memory: loaded vae: 167639366 bytes (159.87 MB)
memory: weights 20320526278 bytes (18.92 GB); host peak while loading 21222895616 bytes (19.77 GB), anonymous 20400000000 bytes; resident now 1 bytes
reserve: 123.75 MB (the largest activation estimate: the simulated card is charged exactly that, so no margin)
memory: host peak during encode: 20542349312 bytes (19.13 GB), anonymous 20500000000 bytes
memory: host peak during denoise: 20658356224 bytes (19.24 GB), anonymous 20600000000 bytes
memory: host peak during decode: 20652650496 bytes (19.23 GB), anonymous 20600000000 bytes
wrote real-size.png

phases:
encode     28.244 s (release 0.000 s)
denoise   157.988 s (release 0.000 s)
decode     22.679 s (release 0.000 s)
total     208.911 s
";

    /// The lines of the CLI a host-budget run prints, among others it skips (made-up figures of the right shape).
    fn budget_run(anonymous: [u64; 4], first_step: f64, denoise: f64) -> String {
        let card: [u64; 4] = [0, 8_000_000_000, 7_900_000_000, 400_000_000];
        let mut out = String::new();
        for ((phase, a), c) in ["load", "encode", "denoise", "decode"].iter().zip(anonymous).zip(card) {
            out.push_str(&format!("host_budget phase={phase} anonymous_peak={a} card_peak={c} weights=20320526278\n"));
            if *phase == "encode" {
                out.push_str(&format!("time_to_first_step seconds={first_step}\n"));
            }
        }
        out.push_str(&format!("phases:\nencode 30.000 s (release 0.000 s)\ndenoise {denoise} s (release 0.000 s)\n"));
        out
    }

    #[test]
    fn the_host_budget_report_sets_the_runs_side_by_side() {
        let ram = HostBudgetRun::read(
            &budget_run([20_400_000_000, 20_500_000_000, 20_600_000_000, 20_600_000_000], 58.2, 150.0),
            260.0,
        )
        .expect("a run");
        let file = HostBudgetRun::read(
            &budget_run([300_000_000, 9_100_000_000, 9_000_000_000, 1_100_000_000], 31.5, 160.0),
            230.0,
        )
        .expect("a run");
        assert!(!ram.within_budget() && file.within_budget());
        let report = host_budget_report(&[("ram tier", ram), ("file tier, 2nd", file)]);
        expect_test::expect![[r#"
            run              phase     anonymous peak   card peak   card + 2.0 GB   within   (GB)
            ram tier         load               20.40        0.00            2.00   no
            ram tier         encode             20.50        8.00           10.00   no
            ram tier         denoise            20.60        7.90            9.90   no
            ram tier         decode             20.60        0.40            2.40   no
            file tier, 2nd   load                0.30        0.00            2.00   yes
            file tier, 2nd   encode              9.10        8.00           10.00   yes
            file tier, 2nd   denoise             9.00        7.90            9.90   yes
            file tier, 2nd   decode              1.10        0.40            2.40   yes

            run              first step (s)   denoise (s)   whole run (s)   within the budget
            ram tier                   58.2         150.0           260.0   no
            file tier, 2nd             31.5         160.0           230.0   every phase

            weights 20.32 GB; the file tier's denoising step (last run) over the RAM tier's: 1.067 (goal <= 1.1: met); time to the first denoising step: file 31.5 s, RAM (the whole model loaded first) 58.2 s
        "#]]
        .assert_eq(&report);
        assert!(HostBudgetRun::read("no report", 1.0).is_err());
    }

    #[test]
    fn the_real_size_report_reads_the_phases_and_the_peaks() {
        let report = real_size_report(RUN, 237.2).expect("a report");
        expect_test::expect![[r#"
            loaded text_encoder: 7843069440 bytes (7.30 GB)
            loaded transformer: 12309817472 bytes (11.46 GB)
            loaded vae: 167639366 bytes (159.87 MB)
            phase      wall (s)   resident peak   x weights   anonymous peak   x weights
            load              -     21222895616       1.044      20400000000       1.004
            encode       28.244     20542349312       1.011      20500000000       1.009
            denoise     157.988     20658356224       1.017      20600000000       1.014
            decode       22.679     20652650496       1.016      20600000000       1.014
            weights 20320526278 bytes; worst resident peak 1.044 x the weights (it counts the mapped pages of the shard being read), worst anonymous peak 1.014 x; largest activation estimate 123.75 MB; whole run 237.2 s (the loading and the process start included)
            goal: host peak <= 1.1 x the weights + the largest activation = 22482340185 bytes: resident met (0.944 of the goal), anonymous met (0.916 of the goal)
        "#]]
        .assert_eq(&report);
        assert!(real_size_report("no report here", 1.0).is_err());
    }
}

/// Arguments of `cargo xtask gpu-bundle`.
#[derive(clap::Args)]
pub struct GpuBundleArgs {
    /// The peer benchmark's folder: its script and the wheels it installs offline on the device.
    #[arg(long, default_value = "../shared/gpu")]
    pub peer: PathBuf,
    /// The folder the archive is written to, relative to the workspace root: the device tool carries it
    /// (`carry [".gpu"]`), and `tools/gpu-check.sh` unpacks it there.
    #[arg(long, default_value = ".gpu")]
    pub out: PathBuf,
    /// The most the archive may weigh (the device tool carries 64 MiB in all).
    #[arg(long, default_value = "60MB")]
    pub max: String,
    /// Pack the binary already built instead of building it (it must exist).
    #[arg(long)]
    pub no_build: bool,
}

/// The archive `cargo xtask gpu-bundle` writes in its `--out` folder.
pub const GPU_BUNDLE: &str = "gpu-bundle.tar.xz";

/// Builds the GPU check for CUDA in release and packs it with the peer benchmark into one archive for the device
/// tool to carry, so a lent accelerator spends its minutes on the check, not on compiling.
///
/// Steps: the LLVM bundle burn's `cuda` feature needs (`setup-cuda`, skipped when installed), then
/// `cargo build --release -p pipeline-zimage --features cuda --example gpu_check` (timed), then
/// `<out>/gpu-bundle.tar.xz` holding `gpu_check` and `peer/` (the peer's script and wheels), refused when it
/// weighs more than `--max`. `tools/gpu-check.sh` unpacks it and runs the whole check.
pub fn gpu_bundle(args: &GpuBundleArgs) -> anyhow::Result<()> {
    let max = offload_core::parse_size(&args.max).with_context(|| format!("--max {}", args.max))?;
    let root = workspace_root();
    let peer = root.join(&args.peer);
    if !peer.join("diffusers_zimage_offload_bench.py").is_file() {
        bail!(
            "{} has no diffusers_zimage_offload_bench.py: pass --peer with the peer benchmark's folder \
             (shared/gpu in this project)",
            peer.display()
        );
    }
    let target_dir = std::env::var_os("CARGO_TARGET_DIR").map_or_else(|| root.join("target"), PathBuf::from);
    let binary = target_dir.join("release").join("examples").join("gpu_check");
    let build_seconds = if args.no_build {
        None
    } else {
        setup_cuda(&SetupCudaArgs { python: "python3".into(), into: None })?;
        let started = std::time::Instant::now();
        let mut build = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
        build.args(["build", "--release", "-p", "pipeline-zimage", "--features", "cuda", "--example", "gpu_check"]);
        status(build, "the CUDA release build of the GPU check")?;
        Some(started.elapsed().as_secs_f64())
    };
    if !binary.is_file() {
        bail!("{} is missing: run without --no-build to build it", binary.display());
    }
    let out = root.join(&args.out);
    std::fs::create_dir_all(&out).with_context(|| format!("creating {}", out.display()))?;
    // A directory of this command's own, made fresh (refused if it exists), so removing it removes only what
    // this command put there.
    let staging = std::env::temp_dir().join(format!("xtask-gpu-bundle-{}", std::process::id()));
    std::fs::create_dir(&staging)
        .with_context(|| format!("creating {} (remove it if a run left it)", staging.display()))?;
    std::fs::copy(&binary, staging.join("gpu_check")).context("copying the binary")?;
    copy_tree(&peer, &staging.join("peer"))?;
    let archive = out.join(GPU_BUNDLE);
    let started = std::time::Instant::now();
    let packed = std::fs::File::create(&archive).with_context(|| format!("creating {}", archive.display()))?;
    let mut tar = Command::new("tar");
    tar.arg("-C").arg(&staging).args(["-cf", "-", "gpu_check", "peer"]).stdout(std::process::Stdio::piped());
    let mut tar = tar.spawn().context("cannot start tar")?;
    let tar_out = tar.stdout.take().context("tar's output")?;
    let xz = Command::new("xz")
        .args(["-T0", "-6", "-c"])
        .stdin(tar_out)
        .stdout(packed)
        .status()
        .context("cannot start xz (apt-get install xz-utils)")?;
    let tarred = tar.wait()?;
    if !(tarred.success() && xz.success()) {
        bail!("packing {} failed (tar {tarred}, xz {xz})", archive.display());
    }
    let pack_seconds = started.elapsed().as_secs_f64();
    std::fs::remove_dir_all(&staging).ok();
    let binary_bytes = std::fs::metadata(&binary)?.len();
    let archive_bytes = std::fs::metadata(&archive)?.len();
    let fmt = offload_core::format_size;
    match build_seconds {
        Some(seconds) => println!("built the CUDA release gpu_check in {seconds:.0} s ({})", fmt(binary_bytes)),
        None => println!("packed the gpu_check built before ({})", fmt(binary_bytes)),
    }
    println!(
        "wrote {} ({}, packed in {pack_seconds:.0} s): gpu_check and the peer benchmark; carry [\"{}\"] and run \
         `bash tools/gpu-check.sh` with the device tool",
        archive.display(),
        fmt(archive_bytes),
        args.out.display()
    );
    if archive_bytes > max {
        bail!(
            "{} weighs {}, over --max {}: the device tool would not carry it; strip the binary or drop wheels \
             the peer does not import",
            archive.display(),
            fmt(archive_bytes),
            fmt(max)
        );
    }
    Ok(())
}
