//! Nothing lost, whatever the input, through the CLI binary: every output is checked before the weights load and
//! written atomically, every input file and option is read and checked first, the checkpoint's components are
//! checked against each other, and absurd counts are typed errors (exit 1), never an abort or a panic.
//!
//! "Before the weights load" is read off the binary's own output: a loaded checkpoint prints one load report per
//! component (`... tensors applied from ...`), so a refusal whose output has none came before any weight was read.

use std::path::{Path, PathBuf};
use std::process::Command;

mod common;

/// What one run of the binary did.
struct Run {
    code: Option<i32>,
    output: String,
}

impl Run {
    /// Whether the checkpoint's weights were read (a load report was printed).
    fn loaded(&self) -> bool {
        self.output.contains("tensors applied from")
    }

    /// Asserts the run was refused with exit code 1 (a typed error, not a panic's 101 or an abort's 134), before
    /// any weight loaded, with `words` in its message.
    fn refused_before_loading(&self, words: &str) {
        assert_eq!(self.code, Some(1), "exit code of a typed error: {}", self.output);
        assert!(!self.loaded(), "refused only after the weights loaded: {}", self.output);
        assert!(self.output.contains(words), "{words:?} missing from: {}", self.output);
    }
}

/// Runs `pipeline-zimage generate` on the tiny checkpoint (64×64, 2 steps, 32 tokens unless `args` says
/// otherwise) with `args`.
fn generate(args: &[&str]) -> Run {
    let defaults = [("--height", "64"), ("--width", "64"), ("--steps", "2"), ("--max-sequence-length", "32")];
    let mut command = Command::new(env!("CARGO_BIN_EXE_pipeline-zimage"));
    command.arg("generate");
    for (flag, value) in defaults {
        if !args.contains(&flag) {
            command.args([flag, value]);
        }
    }
    let run = command.args(args).output().expect("the CLI runs");
    let output = format!("{}\n{}", String::from_utf8_lossy(&run.stdout), String::from_utf8_lossy(&run.stderr));
    Run { code: run.status.code(), output }
}

/// A fresh directory for one test's files.
fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("nothing-lost-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("a scratch directory");
    dir
}

fn text(path: &Path) -> &str {
    path.to_str().expect("a UTF-8 path")
}

#[test]
fn a_bad_out_is_refused_before_loading_and_an_existing_file_keeps_its_bytes() {
    let dir = scratch("out");
    let precious = b"precious jpeg bytes";
    for name in ["photo.jpg", "photo.webp", "photo"] {
        let path = dir.join(name);
        std::fs::write(&path, precious).expect("write");
        generate(&["--out", text(&path)]).refused_before_loading("give a name ending in .png");
        assert_eq!(std::fs::read(&path).expect("read"), precious, "{name} was changed");
    }
    let missing = dir.join("missing-dir").join("x.png");
    generate(&["--out", text(&missing)]).refused_before_loading("does not exist; create it first");
    assert!(!missing.exists());
    generate(&["--out", text(&dir)]).refused_before_loading("is a directory");
    // A bad --out-tensor costs nothing either, and names the path the user gave.
    let png = dir.join("fine.png");
    let tensor = dir.join("missing-dir").join("image.safetensors");
    let run = generate(&["--out", text(&png), "--out-tensor", text(&tensor)]);
    run.refused_before_loading(&format!("--out-tensor {}", tensor.display()));
    assert!(!run.output.contains(".tmp"), "the error names a temporary file: {}", run.output);
    generate(&["--out", text(&png), "--out-tensor", text(&dir.join("image.npy"))])
        .refused_before_loading("give a name ending in .safetensors");
    // Nothing was created by any of the refusals.
    let mut left: Vec<String> = std::fs::read_dir(&dir)
        .expect("list")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into())
        .collect();
    left.sort();
    assert_eq!(left, ["photo", "photo.jpg", "photo.webp"]);
}

#[test]
fn two_outputs_naming_one_file_or_an_input_are_refused() {
    let dir = scratch("collide");
    let same = dir.join("same.png");
    generate(&["--card", "8MB", "--out", text(&same), "--memory-plot", text(&same)])
        .refused_before_loading("--out and --memory-plot both name");
    generate(&["--out", text(&same), "--trace", text(&dir.join(".").join("same.png"))])
        .refused_before_loading("--out and --trace both name");
    // With several images the numbered names count: --trace may not take image 2's.
    generate(&["--out", text(&dir.join("a.png")), "--images", "2", "--trace", text(&dir.join("a-2.png"))])
        .refused_before_loading("both name");
    let input = dir.join("input.png");
    image::RgbImage::new(64, 64).save(&input).expect("an input image");
    let before = std::fs::read(&input).expect("read");
    generate(&["--image", text(&input), "--out", text(&input)]).refused_before_loading("--out would replace --image");
    assert_eq!(std::fs::read(&input).expect("read"), before);
    assert!(!same.exists());
}

#[test]
fn a_run_replaces_an_existing_output_whole_and_leaves_no_temporary_file() {
    let dir = scratch("replace");
    let out = dir.join("image.png");
    std::fs::write(&out, b"an older image").expect("write");
    let run = generate(&["--out", text(&out), "--out-tensor", text(&dir.join("image.safetensors"))]);
    assert_eq!(run.code, Some(0), "{}", run.output);
    let written = image::open(&out).expect("a PNG").to_rgb8();
    assert_eq!(written.dimensions(), (64, 64));
    let mut left: Vec<String> = std::fs::read_dir(&dir)
        .expect("list")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into())
        .collect();
    left.sort();
    assert_eq!(left, ["image.png", "image.safetensors"], "no temporary file is left");
}

#[test]
fn input_files_and_options_are_read_before_loading() {
    let dir = scratch("inputs");
    let out = dir.join("out.png");
    let missing = dir.join("missing.safetensors");
    generate(&["--out", text(&out), "--lora", text(&missing)]).refused_before_loading("missing.safetensors");
    generate(&["--out", text(&out), "--image", text(&dir.join("missing.png"))])
        .refused_before_loading("cannot read the image");
    let not_latents = dir.join("not-latents.safetensors");
    std::fs::write(&not_latents, b"not a safetensors file").expect("write");
    generate(&["--out", text(&out), "--latents", text(&not_latents)])
        .refused_before_loading("is not a safetensors file");
    // A scheme the CPU backend does not compute, refused by name before the weights load.
    generate(&["--out", text(&out), "--quantize", "e4m3"]).refused_before_loading("cannot quantize text_encoder");
    // A settings file that cannot be read, and a bad setting.
    generate(&["--out", text(&out), "--card", "8MB", "--config", text(&dir.join("missing.toml"))])
        .refused_before_loading("cannot read the settings file");
    // A latents tensor of the wrong shape for this checkpoint.
    let latents = dir.join("latents.safetensors");
    let data = vec![0u8; 4 * 4 * 4 * 4];
    let view = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![1, 4, 4, 4], &data).expect("view");
    safetensors::serialize_to_file([("latents", view)], None, &latents).expect("write latents");
    generate(&["--out", text(&out), "--latents", text(&latents)]).refused_before_loading("expected [1, 16, 8, 8]");
    assert!(!out.exists());
}

#[test]
fn absurd_counts_are_typed_errors_not_aborts_or_panics() {
    let dir = scratch("counts");
    let out = dir.join("out.png");
    let out = text(&out);
    generate(&["--out", out, "--images", "1000000000000000"]).refused_before_loading("--images 1000000000000000");
    generate(&["--out", out, "--images", "0"]).refused_before_loading("--images 0");
    generate(&[
        "--out",
        out,
        "--card",
        "3MB",
        "--preset",
        "diffusers_offload_compat",
        "--set",
        "prefetch_depth=18446744073709551615",
    ])
    .refused_before_loading("from 1 to 64");
    generate(&["--out", out, "--steps", "1000000000000"]).refused_before_loading("steps");
    generate(&["--out", out, "--max-sequence-length", "1000000000000"]).refused_before_loading("max_sequence_length");
    generate(&["--out", out, "--height", "1000000"]).refused_before_loading("largest accepted");
}

/// A copy of the tiny checkpoint in `dir` whose `component/config.json` has `field` set to `value` (the weight
/// files are linked, not copied).
fn checkpoint_with(dir: &Path, component: &str, field: &str, value: serde_json::Value) -> PathBuf {
    let tiny = common::fixtures().join("tiny-z-image-turbo");
    let copy = dir.join(format!("{component}-{field}"));
    for entry in walk(&tiny) {
        let relative = entry.strip_prefix(&tiny).expect("inside");
        let target = copy.join(relative);
        std::fs::create_dir_all(target.parent().expect("a parent")).expect("mkdir");
        if relative == Path::new(component).join("config.json") {
            let mut config: serde_json::Value =
                serde_json::from_str(&std::fs::read_to_string(&entry).expect("read")).expect("json");
            config[field] = value.clone();
            std::fs::write(&target, serde_json::to_string_pretty(&config).expect("json")).expect("write");
        } else {
            std::os::unix::fs::symlink(&entry, &target).expect("link");
        }
    }
    copy
}

fn walk(dir: &Path) -> Vec<PathBuf> {
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir).expect("list") {
        let path = entry.expect("entry").path();
        if path.is_dir() { files.extend(walk(&path)) } else { files.push(path) }
    }
    files
}

#[test]
fn components_that_do_not_fit_together_are_refused_when_the_checkpoint_opens() {
    let dir = scratch("components");
    let out = dir.join("out.png");
    let cases = [
        // Loaded consistently, this one used to run the whole pipeline and then panic writing the PNG (exit 101).
        ("vae", "out_channels", serde_json::json!(1), "vae/config.json and the pipeline's RGB images"),
        ("vae", "latent_channels", serde_json::json!(8), "vae/config.json and transformer/config.json"),
        ("transformer", "cap_feat_dim", serde_json::json!(48), "text_encoder/config.json and transformer/config.json"),
    ];
    for (component, field, value, words) in cases {
        let checkpoint = checkpoint_with(&dir, component, field, value);
        generate(&["--weights", text(&checkpoint), "--out", text(&out)]).refused_before_loading(words);
    }
    assert!(!out.exists());
}
