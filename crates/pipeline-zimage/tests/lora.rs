//! LoRA on the tiny checkpoint: the image equals diffusers' `load_lora_weights` (both layouts, two LoRAs at once,
//! a text encoder part) in both modes; every offload route gives the resident-with-LoRA image; removing or
//! changing a LoRA restores the base weights bit for bit; bad files are typed errors that change nothing. The
//! files and goldens are made by `tools/make_lora_fixtures.py` (`cargo xtask fixtures`).

mod common;

use burn::module::{Module, ModuleVisitor, Param};
use burn::tensor::Tensor;
use common::{fixtures, golden, load_tiny, max_abs_diff, tensor4, values};
use group_offload::{GroupLevel, GroupOptions, OffloadDevice};
use memory_sim::{CardSpec, Mode, SimCard};
use pipeline_zimage::Error;
use pipeline_zimage::lora::{LoraMode, LoraSpec, LoraTarget};
use pipeline_zimage::pipeline::{GenerateOptions, ZImagePipeline};
use std::path::PathBuf;

const MODES: [LoraMode; 2] = [LoraMode::Fused, LoraMode::Runtime];

fn lora_file(name: &str) -> PathBuf {
    fixtures().join("lora").join(name)
}

/// The cases of `golden/lora.json`: name and files with scales.
fn cases() -> Vec<(String, Vec<LoraSpec>)> {
    let text = std::fs::read_to_string(fixtures().join("golden/lora.json")).expect("golden/lora.json");
    let facts: serde_json::Value = serde_json::from_str(&text).expect("json");
    facts["cases"]
        .as_object()
        .expect("cases")
        .iter()
        .map(|(name, case)| {
            let specs = case["loras"]
                .as_array()
                .expect("loras")
                .iter()
                .map(|l| {
                    LoraSpec::new(
                        lora_file(l["file"].as_str().expect("a file")),
                        l["scale"].as_f64().expect("a scale") as f32,
                    )
                })
                .collect();
            (name.clone(), specs)
        })
        .collect()
}

/// diffusers' options of the LoRA goldens (2 steps at 64x64, 32 tokens, the golden latents).
fn options() -> GenerateOptions {
    let g = golden("lora.safetensors");
    let mut opts = GenerateOptions::turbo("a red fox in the snow");
    (opts.steps, opts.height, opts.width, opts.max_sequence_length) = (2, 64, 64, 32);
    opts.latents = Some(tensor4(&g, "latents"));
    opts
}

fn image(pipeline: &ZImagePipeline) -> Vec<f32> {
    values(pipeline.generate(&options(), &mut |_, _| {}).expect("generate"))
}

/// Every float parameter's bytes, in visit order: what "bit for bit" compares.
/// Each parameter's shape and bytes, in visiting order.
type WeightBits = Vec<(Vec<usize>, Vec<u8>)>;

fn weight_bits<M: Module>(module: &M) -> WeightBits {
    struct Bits(WeightBits);
    impl ModuleVisitor for Bits {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let data = param.val().into_data();
            self.0.push((data.shape().as_slice().to_vec(), data.as_bytes().to_vec()));
        }
    }
    let mut bits = Bits(Vec::new());
    module.visit(&mut bits);
    bits.0
}

fn pipeline_bits(pipeline: &ZImagePipeline) -> (WeightBits, WeightBits) {
    (
        pipeline.transformer().inspect(weight_bits).expect("whole"),
        pipeline.text_encoder().inspect(weight_bits).expect("whole"),
    )
}

#[test]
fn every_case_matches_diffusers_load_lora_weights_in_both_modes() {
    let base = golden("lora.safetensors");
    let mut pipeline = load_tiny(OffloadDevice::host_only());
    assert!(max_abs_diff(&image(&pipeline), &base["base"].1) <= 1e-3, "the base image matches diffusers'");
    for (name, specs) in cases() {
        for mode in MODES {
            let applied = pipeline.set_loras(&specs, mode).expect("the LoRAs apply");
            assert!(applied.layers(LoraTarget::Transformer) > 0, "{name}: nothing applied");
            let got = image(&pipeline);
            let error = max_abs_diff(&got, &base[&name].1);
            let moved = max_abs_diff(&base[&name].1, &base["base"].1);
            println!("{name} ({mode}): max abs error against diffusers {error:.2e} (the LoRA moves it {moved:.2e})");
            assert!(error <= 1e-3, "{name} ({mode}): {error}");
            assert!(moved > 100.0 * error.max(1e-6), "{name}: the LoRA changes the image far more than the error");
        }
    }
    let te = pipeline
        .set_loras(&[LoraSpec::new(lora_file("with-text-encoder.safetensors"), 0.5)], LoraMode::Fused)
        .expect("applies");
    assert_eq!(te.layers(LoraTarget::TextEncoder), 14, "both built decoder layers' 7 linears");
    assert_eq!(te.skipped().len(), 7, "the last decoder layer, which the pipeline never runs");
}

#[test]
fn removing_or_changing_a_lora_restores_the_base_weights_bit_for_bit() {
    let mut pipeline = load_tiny(OffloadDevice::host_only());
    let base = pipeline_bits(&pipeline);
    let base_image = image(&pipeline);
    let peft = [LoraSpec::new(lora_file("peft.safetensors"), 0.75)];
    let both = [
        LoraSpec::new(lora_file("kohya.safetensors"), 1.0),
        LoraSpec::new(lora_file("with-text-encoder.safetensors"), 0.5),
    ];
    for mode in MODES {
        pipeline.set_loras(&peft, mode).expect("applies");
        let fused = pipeline_bits(&pipeline);
        match mode {
            LoraMode::Fused => assert_eq!(fused.0.len(), base.0.len(), "fused: no new parameters"),
            LoraMode::Runtime => assert!(fused.0.len() > base.0.len(), "runtime: the low-rank terms are parameters"),
        }
        assert_ne!(fused.0, base.0, "{mode}: the transformer changed");
        let applied = pipeline.set_loras(&both, mode).expect("changes");
        println!(
            "{mode}: {} of {} fused elements need a correction to come back, kept in {} bytes",
            applied.corrections(),
            applied.fused_elements(),
            applied.correction_bytes()
        );
        // The fixture's LoRAs are as large as the weights (a worst case): still less than a copy of them.
        assert!(applied.correction_bytes() <= 4 * applied.fused_elements(), "never more than a second f32 copy");
        if mode == LoraMode::Fused {
            assert!(applied.correction_bytes() < 4 * applied.fused_elements(), "less than a second f32 copy");
        }
        assert_ne!(pipeline_bits(&pipeline).1, base.1, "{mode}: the text encoder changed");
        pipeline.set_loras(&[], mode).expect("removes");
        assert!(pipeline.loras().is_empty());
        assert!(pipeline_bits(&pipeline) == base, "{mode}: the base weights are back bit for bit");
        assert_eq!(image(&pipeline), base_image, "{mode}: and so is the image");
    }
}

/// The image of the tiny pipeline with `specs` applied in `mode` under `route` (`resident`; `auto` offload on a
/// hard simulated card; `block`, `leaf` or `disk`: both encoders under group offload at that level, the disk
/// store in `store`, then auto offload), and the run's offload record (none when resident).
fn route_image(
    specs: &[LoraSpec],
    mode: LoraMode,
    route: &str,
    store: &std::path::Path,
) -> (Vec<f32>, Option<offload_core::OffloadRecord>) {
    let card = SimCard::new(CardSpec::parse("1GiB").expect("a size").with_mode(Mode::Hard).with_context_overhead(0));
    let placement =
        if route == "resident" { OffloadDevice::host_only() } else { OffloadDevice::simulated(card.clone()) };
    let mut pipeline = load_tiny(placement);
    pipeline.set_loras(specs, mode).expect("applies");
    let grouped = |level: GroupLevel| GroupOptions { level, ..GroupOptions::default() };
    let options = match route {
        "block" => Some(grouped(GroupLevel::Block { blocks_per_group: 1 })),
        "leaf" => Some(grouped(GroupLevel::Leaf)),
        "disk" => Some(GroupOptions { disk_store: Some(store.to_path_buf()), ..grouped(GroupLevel::Leaf) }),
        _ => None,
    };
    if let Some(options) = &options {
        for component in ["text_encoder", "transformer"] {
            pipeline.enable_group_offload_with(component, options).expect("group offload");
        }
        let refused = pipeline.set_loras(&[], mode).expect_err("refused under group offload");
        assert!(matches!(refused, Error::LoraUnsupported { .. }), "{refused:?}");
    }
    if route != "resident" {
        pipeline.enable_auto_offload(0, true).expect("auto offload");
    }
    let image = image(&pipeline);
    let record = (route != "resident").then(|| pipeline.manager().offload_record());
    (image, record)
}

#[test]
fn every_route_gives_the_resident_with_lora_image() {
    let specs = [
        LoraSpec::new(lora_file("peft.safetensors"), 0.75),
        LoraSpec::new(lora_file("with-text-encoder.safetensors"), 0.5),
    ];
    let store = std::env::temp_dir().join(format!("lora-store-{}", std::process::id()));
    for mode in MODES {
        let (resident, _) = route_image(&specs, mode, "resident", &store);
        for route in ["auto", "block", "leaf", "disk"] {
            let (got, record) = route_image(&specs, mode, route, &store);
            let error = max_abs_diff(&got, &resident);
            println!("{mode} under {route}: max abs difference from resident {error:.2e}");
            assert!(error <= 1e-6, "{mode} under {route}: {error}");
            let record = record.expect("a record");
            assert!(!record.events().is_empty(), "{route}: something moved");
        }
    }
    let _ = std::fs::remove_dir_all(&store);
}

/// Bytes onloaded in a run, from its record.
fn onloaded_bytes(record: &offload_core::OffloadRecord) -> u64 {
    record.events().iter().filter(|e| e.action == offload_core::Action::Onload).map(|e| e.bytes).sum()
}

#[test]
fn a_fused_lora_streams_the_same_bytes_and_a_disk_store_re_keys() {
    let specs = [LoraSpec::new(lora_file("peft.safetensors"), 0.75)];
    let base_store = std::env::temp_dir().join(format!("lora-base-store-{}", std::process::id()));
    let lora_store = std::env::temp_dir().join(format!("lora-fused-store-{}", std::process::id()));
    let (_, base) = route_image(&[], LoraMode::Fused, "disk", &base_store);
    let (_, fused) = route_image(&specs, LoraMode::Fused, "disk", &lora_store);
    let (_, runtime) = route_image(&specs, LoraMode::Runtime, "block", &lora_store.join("unused"));
    let (base, fused, runtime) = (base.unwrap(), fused.unwrap(), runtime.unwrap());
    assert!(onloaded_bytes(&base) > 0);
    assert_eq!(onloaded_bytes(&fused), onloaded_bytes(&base), "fused: the same bytes as without a LoRA");
    let (_, block_base) = route_image(&[], LoraMode::Fused, "block", &lora_store.join("unused"));
    assert!(onloaded_bytes(&runtime) > onloaded_bytes(&block_base.unwrap()), "runtime: the low-rank terms travel too");
    let names = |dir: &std::path::Path| -> std::collections::BTreeSet<String> {
        std::fs::read_dir(dir).expect("the store").map(|e| e.unwrap().file_name().to_string_lossy().into()).collect()
    };
    let (base_files, lora_files) = (names(&base_store), names(&lora_store));
    assert_eq!(base_files.len(), lora_files.len(), "the same groups");
    let same = base_files.intersection(&lora_files).count();
    println!("{same} of {} group files shared with the base store", base_files.len());
    assert!(same < base_files.len(), "groups whose weights changed got new content keys");
    assert!(same > 0, "groups the LoRA leaves alone (the text encoder's, the embedders') keep theirs");
    let _ = std::fs::remove_dir_all(&base_store);
    let _ = std::fs::remove_dir_all(&lora_store);
}

/// One tensor of a LoRA file written by a test: its key, dtype, shape and little-endian bytes.
struct FileTensor {
    key: String,
    dtype: safetensors::Dtype,
    shape: Vec<usize>,
    bytes: Vec<u8>,
}

/// An f32 tensor of `shape` whose values are `0.01 · i`, except where `edit` gives another.
fn f32_tensor(key: &str, shape: &[usize], edit: impl Fn(usize) -> Option<f32>) -> FileTensor {
    let n: usize = shape.iter().product();
    let bytes = (0..n).flat_map(|i| edit(i).unwrap_or(0.01 * i as f32).to_le_bytes()).collect();
    FileTensor { key: key.into(), dtype: safetensors::Dtype::F32, shape: shape.to_vec(), bytes }
}

/// An f32 scalar (an alpha).
fn f32_scalar(key: &str, value: f32) -> FileTensor {
    FileTensor {
        key: key.into(),
        dtype: safetensors::Dtype::F32,
        shape: Vec::new(),
        bytes: value.to_le_bytes().to_vec(),
    }
}

/// A safetensors file in the temporary directory holding `tensors` and, if given, diffusers'
/// `lora_adapter_metadata`.
fn write_tensors(name: &str, tensors: &[FileTensor], metadata: Option<&str>) -> PathBuf {
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
        .iter()
        .map(|t| {
            let view = safetensors::tensor::TensorView::new(t.dtype, t.shape.clone(), &t.bytes).expect("a tensor view");
            (t.key.clone(), view)
        })
        .collect();
    let metadata = metadata.map(|m| std::collections::HashMap::from([("lora_adapter_metadata".to_string(), m.into())]));
    let path = std::env::temp_dir().join(format!("bad-lora-{}-{name}.safetensors", std::process::id()));
    safetensors::serialize_to_file(views, metadata, &path).expect("written");
    path
}

/// A LoRA file with the given f32 tensors (values `0.01 · i`) and metadata.
fn write_lora(name: &str, tensors: &[(&str, Vec<usize>)], metadata: Option<&str>) -> PathBuf {
    let tensors: Vec<FileTensor> = tensors.iter().map(|(key, shape)| f32_tensor(key, shape, |_| None)).collect();
    write_tensors(name, &tensors, metadata)
}

#[test]
fn bad_files_are_typed_errors_naming_the_key_and_change_nothing() {
    let mut pipeline = load_tiny(OffloadDevice::host_only());
    let good = LoraSpec::new(lora_file("peft.safetensors"), 1.0);
    pipeline.set_loras(std::slice::from_ref(&good), LoraMode::Fused).expect("a good LoRA first");
    let before = pipeline_bits(&pipeline);
    let q = "transformer.layers.0.attention.to_q";
    let cases: Vec<(&str, PathBuf, &str)> = vec![
        (
            "unknown layer",
            write_lora(
                "unknown",
                &[
                    ("transformer.layers.9.attention.to_q.lora_A.weight", vec![2, 64]),
                    ("transformer.layers.9.attention.to_q.lora_B.weight", vec![64, 2]),
                ],
                None,
            ),
            "transformer.layers.9.attention.to_q.lora_A.weight",
        ),
        (
            "wrong shape",
            write_lora(
                "shape",
                &[(&format!("{q}.lora_A.weight"), vec![2, 32]), (&format!("{q}.lora_B.weight"), vec![64, 2])],
                None,
            ),
            "transformer.layers.0.attention.to_q.lora_A.weight",
        ),
        (
            "ranks differ",
            write_lora(
                "rank",
                &[(&format!("{q}.lora_A.weight"), vec![4, 64]), (&format!("{q}.lora_B.weight"), vec![64, 3])],
                None,
            ),
            "transformer.layers.0.attention.to_q.lora_A.weight",
        ),
        (
            "metadata rank",
            write_lora(
                "metadata",
                &[(&format!("{q}.lora_A.weight"), vec![2, 64]), (&format!("{q}.lora_B.weight"), vec![64, 2])],
                Some(r#"{"transformer.r": 4, "transformer.lora_alpha": 4}"#),
            ),
            "transformer.layers.0.attention.to_q.lora_A.weight",
        ),
        ("not a lora key", write_lora("foreign", &[("unet.conv_in.weight", vec![2, 2])], None), "unet.conv_in.weight"),
        ("half a pair", write_lora("half", &[(&format!("{q}.lora_A.weight"), vec![2, 64])], None), "lora_A.weight"),
    ];
    for (what, path, key) in &cases {
        // A bad file after a good one: the good one is not applied either.
        let error = pipeline
            .set_loras(&[LoraSpec::new(lora_file("kohya.safetensors"), 1.0), LoraSpec::new(path, 1.0)], LoraMode::Fused)
            .expect_err(what);
        let message = error.to_string();
        println!("{what}: {message}");
        assert!(matches!(error, Error::LoraKey { .. } | Error::LoraShape { .. }), "{what}: {error:?}");
        assert!(message.contains(key), "{what}: the message names the key: {message}");
        assert!(message.contains("nothing was applied"), "{message}");
        assert!(pipeline_bits(&pipeline) == before, "{what}: nothing changed");
        assert_eq!(pipeline.loras().specs(), std::slice::from_ref(&good), "{what}: the LoRA applied before stays");
        let _ = std::fs::remove_file(path);
    }
    let missing = pipeline.set_loras(&[LoraSpec::new("/nonexistent/x.safetensors", 1.0)], LoraMode::Runtime);
    assert!(matches!(missing, Err(Error::LoraFile { .. })), "{missing:?}");
    assert!(pipeline_bits(&pipeline) == before);
}

/// What a refused LoRA must leave: the error's message names `expect`, says nothing was applied, and the
/// pipeline holds exactly the weights and the LoRAs it held before.
fn assert_refused_and_unchanged(
    pipeline: &ZImagePipeline,
    what: &str,
    error: &Error,
    expect: &[&str],
    before: &(WeightBits, WeightBits),
    applied_before: &[LoraSpec],
) {
    let message = error.to_string();
    println!("{what}: {message}");
    for text in expect {
        assert!(message.contains(text), "{what}: the message names {text:?}: {message}");
    }
    assert!(message.contains("nothing was applied"), "{what}: {message}");
    assert!(pipeline_bits(pipeline) == *before, "{what}: nothing changed");
    assert_eq!(pipeline.loras().specs(), applied_before, "{what}: the LoRAs applied before stay");
}

#[test]
fn non_finite_factors_alphas_and_scales_are_refused_by_name_in_both_modes() {
    let mut pipeline = load_tiny(OffloadDevice::host_only());
    let good = [LoraSpec::new(lora_file("peft.safetensors"), 1.0)];
    pipeline.set_loras(&good, LoraMode::Fused).expect("a good LoRA first");
    let before = pipeline_bits(&pipeline);
    let q = "transformer.layers.0.attention.to_q";
    let k = "lora_unet_layers_0_attention_to_q";
    let pair = |edit_down: fn(usize) -> Option<f32>, edit_up: fn(usize) -> Option<f32>| {
        vec![
            f32_tensor(&format!("{q}.lora_A.weight"), &[2, 64], edit_down),
            f32_tensor(&format!("{q}.lora_B.weight"), &[64, 2], edit_up),
        ]
    };
    let kohya = |alpha: f32, edit_down: fn(usize) -> Option<f32>| {
        vec![
            f32_tensor(&format!("{k}.lora_down.weight"), &[2, 64], edit_down),
            f32_tensor(&format!("{k}.lora_up.weight"), &[64, 2], |_| None),
            f32_scalar(&format!("{k}.alpha"), alpha),
        ]
    };
    let f64_factor = FileTensor {
        key: format!("{q}.lora_A.weight"),
        dtype: safetensors::Dtype::F64,
        shape: vec![2, 64],
        bytes: (0..128).flat_map(|i| if i == 3 { 1e300f64 } else { 0.01 }.to_le_bytes()).collect(),
    };
    let finite = pair(|_| None, |_| None);
    // (what, the file, its scale, what the message must name)
    let cases: Vec<(&str, PathBuf, f32, Vec<String>)> = vec![
        (
            "NaN in lora_A",
            write_tensors("nan-a", &pair(|i| (i == 17).then_some(f32::NAN), |_| None), None),
            1.0,
            vec![format!("{q}.lora_A.weight"), "NaN".into(), "index 17".into()],
        ),
        (
            "infinity in lora_B",
            write_tensors("inf-b", &pair(|_| None, |i| (i >= 100).then_some(f32::INFINITY)), None),
            1.0,
            vec![format!("{q}.lora_B.weight"), "28 values".into()],
        ),
        (
            "-infinity in a Kohya lora_down",
            write_tensors("inf-down", &kohya(2.0, |i| (i == 0).then_some(f32::NEG_INFINITY)), None),
            1.0,
            vec![format!("{k}.lora_down.weight"), "-inf".into()],
        ),
        ("NaN alpha", write_tensors("nan-alpha", &kohya(f32::NAN, |_| None), None), 1.0, vec![format!("{k}.alpha")]),
        (
            "an f64 factor past f32's range",
            write_tensors("f64", &[f64_factor, f32_tensor(&format!("{q}.lora_B.weight"), &[64, 2], |_| None)], None),
            1.0,
            vec![format!("{q}.lora_A.weight"), "f32".into()],
        ),
        (
            "a metadata alpha past f32's range",
            write_tensors("meta-alpha", &finite, Some(r#"{"transformer.r": 2, "transformer.lora_alpha": 1e39}"#)),
            1.0,
            vec!["lora_alpha".into(), "finite".into()],
        ),
        ("a NaN scale", write_tensors("scale-nan", &finite, None), f32::NAN, vec!["scale NaN".into()]),
        ("an infinite scale", write_tensors("scale-inf", &finite, None), f32::INFINITY, vec!["scale inf".into()]),
        ("a scale of 1e30", write_tensors("scale-huge", &finite, None), 1e30, vec!["1e30".into(), "100".into()]),
        (
            "alpha times the scale past f32's range",
            write_tensors("alpha-huge", &kohya(3e38, |_| None), None),
            100.0,
            vec![format!("{k}.alpha"), "not a finite number".into()],
        ),
    ];
    for mode in MODES {
        for (what, path, scale, expect) in &cases {
            let specs = [LoraSpec::new(lora_file("kohya.safetensors"), 1.0), LoraSpec::new(path, *scale)];
            let error = pipeline.set_loras(&specs, mode).expect_err(what);
            assert!(
                matches!(error, Error::LoraValue { .. } | Error::LoraFile { .. }),
                "{what} ({mode}): a value error, not {error:?}"
            );
            let mut expect: Vec<&str> = expect.iter().map(String::as_str).collect();
            let file = path.file_name().and_then(|n| n.to_str()).expect("a file name");
            expect.push(file);
            assert_refused_and_unchanged(&pipeline, what, &error, &expect, &before, &good);
        }
    }
    for (_, path, _, _) in &cases {
        let _ = std::fs::remove_file(path);
    }
}

#[test]
fn a_module_given_a_factor_twice_is_refused_naming_both_keys() {
    let mut pipeline = load_tiny(OffloadDevice::host_only());
    let good = [LoraSpec::new(lora_file("peft.safetensors"), 1.0)];
    pipeline.set_loras(&good, LoraMode::Fused).expect("a good LoRA first");
    let before = pipeline_bits(&pipeline);
    let q = "layers.0.attention.to_q";
    let t = |key: &str, shape: &[usize]| f32_tensor(key, shape, |_| None);
    let cases: Vec<(&str, Vec<FileTensor>, [String; 2])> = vec![
        (
            "two down factors (PEFT's adapter name and none)",
            vec![
                t(&format!("transformer.{q}.lora_A.weight"), &[2, 64]),
                t(&format!("transformer.{q}.lora_A.default.weight"), &[2, 64]),
                t(&format!("transformer.{q}.lora_B.weight"), &[64, 2]),
            ],
            [format!("transformer.{q}.lora_A.default.weight"), format!("transformer.{q}.lora_A.weight")],
        ),
        (
            "two up factors (two prefixes)",
            vec![
                t(&format!("transformer.{q}.lora_A.weight"), &[2, 64]),
                t(&format!("diffusion_model.{q}.lora_B.weight"), &[64, 2]),
                t(&format!("transformer.{q}.lora_B.weight"), &[64, 2]),
            ],
            [format!("diffusion_model.{q}.lora_B.weight"), format!("transformer.{q}.lora_B.weight")],
        ),
        (
            "two alphas",
            vec![
                t(&format!("transformer.{q}.lora_A.weight"), &[2, 64]),
                t(&format!("transformer.{q}.lora_B.weight"), &[64, 2]),
                f32_scalar(&format!("diffusion_model.{q}.alpha"), 2.0),
                f32_scalar(&format!("transformer.{q}.alpha"), 4.0),
            ],
            [format!("diffusion_model.{q}.alpha"), format!("transformer.{q}.alpha")],
        ),
        (
            "a fused qkv and its query",
            vec![
                t("lora_unet_layers_0_attention_qkv.lora_down.weight", &[2, 64]),
                t("lora_unet_layers_0_attention_qkv.lora_up.weight", &[192, 2]),
                t("lora_unet_layers_0_attention_to_q.lora_down.weight", &[2, 64]),
                t("lora_unet_layers_0_attention_to_q.lora_up.weight", &[64, 2]),
            ],
            [
                "lora_unet_layers_0_attention_qkv.lora_down.weight".into(),
                "lora_unet_layers_0_attention_to_q.lora_down.weight".into(),
            ],
        ),
    ];
    for (what, tensors, keys) in &cases {
        let path = write_tensors(&what.replace(' ', "-"), tensors, None);
        for mode in MODES {
            let error = pipeline.set_loras(&[LoraSpec::new(&path, 1.0)], mode).expect_err(what);
            assert!(matches!(error, Error::LoraKey { .. }), "{what}: {error:?}");
            let expect = [keys[0].as_str(), keys[1].as_str()];
            assert_refused_and_unchanged(&pipeline, what, &error, &expect, &before, &good);
        }
        let _ = std::fs::remove_file(path);
    }
}

#[test]
fn comfyui_and_original_tree_files_fuse_the_weights_of_their_diffusers_equivalents() {
    let mut pipeline = load_tiny(OffloadDevice::host_only());
    let goldens = golden("lora.safetensors");
    // (file, the equivalent file in a layout checked against diffusers, the scale, the golden case)
    for (file, equivalent, scale, case) in [
        ("comfyui.safetensors", "kohya.safetensors", 1.0, "kohya"),
        ("original-tree.safetensors", "peft.safetensors", 0.75, "peft"),
    ] {
        pipeline.set_loras(&[LoraSpec::new(lora_file(equivalent), scale)], LoraMode::Fused).expect("applies");
        let expected = pipeline_bits(&pipeline);
        for mode in MODES {
            let applied = pipeline.set_loras(&[LoraSpec::new(lora_file(file), scale)], mode).expect(file);
            assert_eq!(applied.layers(LoraTarget::Transformer), 42, "{file}: every attention and feed-forward linear");
            if mode == LoraMode::Fused {
                assert!(
                    pipeline_bits(&pipeline) == expected,
                    "{file}: the same fused weights as {equivalent}, bit for bit"
                );
            }
            let error = max_abs_diff(&image(&pipeline), &goldens[case].1);
            println!("{file} ({mode}): max abs error against diffusers' {case} image {error:.2e}");
            assert!(error <= 1e-3, "{file} ({mode}): {error}");
        }
    }
}

/// The transformer's float parameters, bit for bit, of a model held outside a pipeline.
fn model_bits(model: &pipeline_zimage::transformer::ZImageTransformer2DModel) -> WeightBits {
    weight_bits(model)
}

#[test]
fn a_fused_update_that_overflows_is_undone_bit_for_bit_and_named() {
    use pipeline_zimage::lora::{self, AppliedLoras, ComponentLayers, LoraFile};
    for dtype in [burn::tensor::DType::F32, burn::tensor::DType::F16] {
        let options = pipeline_zimage::loading::LoadOptions::new().with_dtype(Some(dtype));
        let pipeline =
            ZImagePipeline::load(fixtures().join("tiny-z-image-turbo"), OffloadDevice::host_only(), &options)
                .expect("the tiny checkpoint loads");
        let mut model = pipeline.transformer().inspect(Clone::clone).expect("whole");
        let layers = ComponentLayers::transformer(&model);
        let base = model_bits(&model);
        let peft = LoraSpec::new(lora_file("peft.safetensors"), 0.75);
        let good = LoraFile::read(&peft.path).expect("reads");
        let good = lora::resolve(&[(good, peft.scale)], &layers, &ComponentLayers::none()).expect("resolves");
        let mut old = AppliedLoras::new(vec![peft.clone()], LoraMode::Fused, Vec::new());
        lora::swap(&mut model, LoraTarget::Transformer, &AppliedLoras::default(), &good, &mut old).expect("fuses");
        let before = model_bits(&model);
        assert!(before != base, "the good LoRA is fused");
        // A modest update of a layer burn visits first, then one whose sum leaves the weights' range: f32's at
        // 1e20 · 1e20, f16's (65504) already at 300 · 300.
        let size = if dtype == burn::tensor::DType::F32 { 1e20 } else { 300.0 };
        let huge = write_tensors(
            &format!("huge-{dtype:?}"),
            &[
                f32_tensor("transformer.noise_refiner.0.feed_forward.w1.lora_A.weight", &[2, 64], |_| None),
                f32_tensor("transformer.noise_refiner.0.feed_forward.w1.lora_B.weight", &[170, 2], |_| None),
                f32_tensor("transformer.layers.1.attention.to_v.lora_A.weight", &[2, 64], |_| Some(size)),
                f32_tensor("transformer.layers.1.attention.to_v.lora_B.weight", &[64, 2], |_| Some(size)),
            ],
            None,
        );
        let spec = LoraSpec::new(&huge, 2.0);
        let file = LoraFile::read(&huge).expect("finite factors read");
        let resolved = lora::resolve(&[(file, spec.scale)], &layers, &ComponentLayers::none()).expect("resolves");
        let mut applied = AppliedLoras::new(vec![spec], LoraMode::Fused, Vec::new());
        let error = lora::swap(&mut model, LoraTarget::Transformer, &old, &resolved, &mut applied)
            .expect_err("the overflow is refused");
        let message = error.to_string();
        println!("{dtype:?}: {message}");
        assert!(matches!(error, Error::LoraNotFinite { .. }), "{error:?}");
        for text in ["layers.1.attention.to_v", "at scale 2", "huge-", "undone", "nothing was applied"] {
            assert!(message.contains(text), "the message names {text:?}: {message}");
        }
        assert!(model_bits(&model) == before, "{dtype:?}: the model holds the good LoRA, bit for bit");
        lora::remove(&mut model, LoraTarget::Transformer, &old);
        assert!(model_bits(&model) == base, "{dtype:?}: and removing it gives the base, bit for bit");
        let _ = std::fs::remove_file(huge);
    }
}

/// A LoRA whose fuse overflows is refused by `set_loras` (`lora::swap`), and the pipeline keeps the LoRAs it had
/// before, bit for bit.
#[test]
fn set_loras_refuses_an_overflowing_fuse_and_keeps_the_loras_before() {
    let mut pipeline = load_tiny(OffloadDevice::host_only());
    let good = [LoraSpec::new(lora_file("peft.safetensors"), 0.75)];
    pipeline.set_loras(&good, LoraMode::Fused).expect("a good LoRA first");
    let before = pipeline_bits(&pipeline);
    let huge = write_tensors(
        "huge-pipeline",
        &[
            f32_tensor("transformer.layers.1.attention.to_v.lora_A.weight", &[2, 64], |_| Some(1e20)),
            f32_tensor("transformer.layers.1.attention.to_v.lora_B.weight", &[64, 2], |_| Some(1e20)),
        ],
        None,
    );
    // A transformer part that fuses and a text encoder part that overflows: the transformer, swapped first, is
    // put back too.
    let huge_text_encoder = write_tensors(
        "huge-text-encoder",
        &[
            f32_tensor("transformer.layers.0.feed_forward.w1.lora_A.weight", &[2, 64], |_| None),
            f32_tensor("transformer.layers.0.feed_forward.w1.lora_B.weight", &[170, 2], |_| None),
            f32_tensor("text_encoder.layers.0.self_attn.q_proj.lora_A.weight", &[2, 32], |_| Some(1e20)),
            f32_tensor("text_encoder.layers.0.self_attn.q_proj.lora_B.weight", &[32, 2], |_| Some(1e20)),
        ],
        None,
    );
    for (file, layer) in [
        (&huge, "transformer's layers.1.attention.to_v"),
        (&huge_text_encoder, "text_encoder's layers.0.self_attn.q_proj"),
    ] {
        let error = pipeline.set_loras(&[LoraSpec::new(file, 1.0)], LoraMode::Fused).expect_err("refused");
        assert!(matches!(error, Error::LoraNotFinite { .. }), "{error:?}");
        assert_refused_and_unchanged(&pipeline, "overflow", &error, &[layer, "at scale 1 "], &before, &good);
    }
    let _ = std::fs::remove_file(huge);
    let _ = std::fs::remove_file(huge_text_encoder);
}

#[test]
fn the_removal_record_never_exceeds_a_plain_copy_and_bf16_comes_back_bit_for_bit() {
    let options = pipeline_zimage::loading::LoadOptions::new().with_dtype(Some(burn::tensor::DType::BF16));
    let mut pipeline =
        ZImagePipeline::load(fixtures().join("tiny-z-image-turbo"), OffloadDevice::host_only(), &options)
            .expect("the tiny checkpoint loads in bf16");
    let base = pipeline_bits(&pipeline);
    // The fixtures' factors are as large as the weights (update σ about the weights' σ): the worst case.
    for scale in [1.0, 0.1, 0.01] {
        let specs = [
            LoraSpec::new(lora_file("peft.safetensors"), 0.75 * scale),
            LoraSpec::new(lora_file("kohya.safetensors"), scale),
            LoraSpec::new(lora_file("with-text-encoder.safetensors"), 0.5 * scale),
        ];
        let applied = pipeline.set_loras(&specs, LoraMode::Fused).expect("applies");
        let records = applied.records();
        assert_eq!(records.len(), 42 + 14, "every fused layer has its record");
        for record in &records {
            assert!(
                record.bytes <= record.copy_bytes,
                "{}: {} bytes kept, a plain copy is {}",
                record.layer,
                record.bytes,
                record.copy_bytes
            );
            assert_eq!(record.copy_bytes, 2 * record.elements, "bf16: two bytes an element");
        }
        let copies = records.iter().filter(|r| r.plain_copy).count();
        println!(
            "scale {scale}: {} of {} elements corrected, {} bytes kept ({:.3} an element), {copies} of {} layers keep \
             a plain copy",
            applied.corrections(),
            applied.fused_elements(),
            applied.correction_bytes(),
            applied.correction_bytes() as f64 / applied.fused_elements() as f64,
            records.len()
        );
        assert!(applied.correction_bytes() <= 2 * applied.fused_elements());
        pipeline.set_loras(&[], LoraMode::Fused).expect("removes");
        assert!(pipeline_bits(&pipeline) == base, "scale {scale}: the bf16 base weights are back bit for bit");
    }
}

/// The committed LoRA fixtures, in the order of their names: the seeds of the reader's fuzzing.
fn fixture_seeds() -> Vec<Vec<u8>> {
    let mut paths: Vec<PathBuf> = std::fs::read_dir(fixtures().join("lora"))
        .expect("the lora fixtures")
        .map(|e| e.expect("an entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
        .collect();
    paths.sort();
    paths.iter().map(|p| std::fs::read(p).expect("readable")).collect()
}

/// Small LoRA files, whose headers are most of their bytes, so that mutations reach the reader's own checks
/// (keys, roles, shapes, alphas, metadata) and not only safetensors' framing.
fn small_seeds() -> Vec<Vec<u8>> {
    let q = "transformer.layers.0.attention.to_q";
    let k = "lora_unet_layers_0_attention_qkv";
    let files: [(&str, Vec<FileTensor>, Option<&str>); 3] = [
        (
            "seed-peft",
            vec![
                f32_tensor(&format!("{q}.lora_A.weight"), &[2, 4], |_| None),
                f32_tensor(&format!("{q}.lora_B.weight"), &[4, 2], |_| None),
            ],
            Some(r#"{"transformer.r": 2, "transformer.lora_alpha": 4, "transformer.alpha_pattern": {"to_q": 2}}"#),
        ),
        (
            "seed-kohya",
            vec![
                f32_tensor(&format!("{k}.lora_down.weight"), &[1, 4], |_| None),
                f32_tensor(&format!("{k}.lora_up.weight"), &[12, 1], |_| None),
                f32_scalar(&format!("{k}.alpha"), 1.0),
            ],
            None,
        ),
        (
            "seed-comfyui",
            vec![
                f32_tensor("diffusion_model.layers.0.attention.out.lora_down.weight", &[1, 4], |_| None),
                f32_tensor("diffusion_model.layers.0.attention.out.lora_up.weight", &[4, 1], |_| None),
                f32_scalar("diffusion_model.layers.0.attention.out.alpha", 1.0),
            ],
            None,
        ),
    ];
    files
        .iter()
        .map(|(name, tensors, metadata)| {
            let path = write_tensors(name, tensors, *metadata);
            let bytes = std::fs::read(&path).expect("written");
            let _ = std::fs::remove_file(path);
            bytes
        })
        .collect()
}

#[test]
fn the_lora_reader_never_panics_on_mutated_files() {
    use pipeline_zimage::lora::LoraFile;
    let path = std::path::Path::new("fuzzed.safetensors");
    let mut seeds = fixture_seeds();
    assert_eq!(seeds.len(), 5);
    seeds.extend(small_seeds());
    for seed in &seeds {
        LoraFile::from_bytes(path, seed).expect("every seed reads");
    }
    // Inputs a mutation rarely reaches: nothing, a header length past the end, a header that is not JSON, a
    // tensor whose offsets leave the buffer, each seed cut at every 997th byte.
    let mut edges: Vec<Vec<u8>> = vec![Vec::new(), vec![0; 7], u64::MAX.to_le_bytes().to_vec()];
    edges.push([&8u64.to_le_bytes()[..], b"not json"].concat());
    let header = br#"{"a.lora_A.weight":{"dtype":"F32","shape":[2,2],"data_offsets":[0,64]}}"#;
    edges.push([&(header.len() as u64).to_le_bytes()[..], header, &[0u8; 16]].concat());
    for seed in &seeds {
        edges.extend((0..seed.len()).step_by(997).map(|n| seed[..n].to_vec()));
    }
    for input in &edges {
        assert!(LoraFile::from_bytes(path, input).is_err(), "{} bytes were accepted", input.len());
    }
    let accepted = std::sync::atomic::AtomicUsize::new(0);
    let report = tests::fuzz::fuzz("lora_file", &seeds, 20_000, 37, |bytes| {
        if LoraFile::from_bytes(path, bytes).is_ok() {
            accepted.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
    });
    println!("{report}; {} accepted", accepted.into_inner());
    assert!(report.crashes.is_empty(), "inputs that panic the reader: {:?}", report.crashes.len());
}

#[test]
fn a_run_that_keeps_its_loras_gives_back_the_removal_records_and_then_refuses_a_change() {
    let mut pipeline = load_tiny(OffloadDevice::host_only());
    let specs = [LoraSpec::new(lora_file("peft.safetensors"), 0.75)];
    pipeline.set_loras(&specs, LoraMode::Fused).expect("applied");
    let fused = pipeline_bits(&pipeline);
    let records = pipeline.loras().correction_bytes();
    assert!(records > 0, "the fuse keeps a removal record");
    assert_eq!(pipeline.keep_loras(), records, "every record's bytes are given back");
    assert_eq!(pipeline.loras().correction_bytes(), 0);
    assert!(pipeline_bits(&pipeline) == fused, "the fused weights stay as they are");
    let error = pipeline.set_loras(&[], LoraMode::Fused).expect_err("no removal without its record");
    assert!(error.to_string().contains("load the checkpoint again"), "{error}");
    assert!(pipeline_bits(&pipeline) == fused, "a refused change changes nothing");
}
