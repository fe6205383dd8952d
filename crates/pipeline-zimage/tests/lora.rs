//! LoRA on the tiny checkpoint: the image equals diffusers' `load_lora_weights` (both layouts, two LoRAs at once,
//! a text encoder part) in both modes; every offload route gives the resident-with-LoRA image; removing or
//! changing a LoRA restores the base weights bit for bit; bad files are typed errors that change nothing. The
//! files and goldens are made by `tools/make_lora_fixtures.py` (`cargo xtask fixtures`).

mod common;

use burn::module::{Module, ModuleVisitor, Param};
use burn::tensor::Tensor;
use common::{fixtures, golden, load_tiny, max_abs_diff, tensor4, values};
use group_offload::{GroupLevel, GroupOptions, Placement};
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
    let mut pipeline = load_tiny(Placement::host_only());
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
    let mut pipeline = load_tiny(Placement::host_only());
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
    let placement = if route == "resident" { Placement::host_only() } else { Placement::simulated(card.clone()) };
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
        pipeline.enable_auto_offload(card.clone(), 0, true).expect("auto offload");
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

/// A LoRA file in memory with the given tensors (f32) and metadata.
fn write_lora(name: &str, tensors: &[(&str, Vec<usize>)], metadata: Option<&str>) -> PathBuf {
    let data: Vec<(String, Vec<u8>, Vec<usize>)> = tensors
        .iter()
        .map(|(key, shape)| {
            let n: usize = shape.iter().product();
            let bytes = (0..n).flat_map(|i| (0.01 * i as f32).to_le_bytes()).collect();
            (key.to_string(), bytes, shape.clone())
        })
        .collect();
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = data
        .iter()
        .map(|(key, bytes, shape)| {
            (
                key.clone(),
                safetensors::tensor::TensorView::new(safetensors::Dtype::F32, shape.clone(), bytes)
                    .expect("a tensor view"),
            )
        })
        .collect();
    let metadata = metadata.map(|m| std::collections::HashMap::from([("lora_adapter_metadata".to_string(), m.into())]));
    let path = std::env::temp_dir().join(format!("bad-lora-{}-{name}.safetensors", std::process::id()));
    safetensors::serialize_to_file(views, metadata, &path).expect("written");
    path
}

#[test]
fn bad_files_are_typed_errors_naming_the_key_and_change_nothing() {
    let mut pipeline = load_tiny(Placement::host_only());
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
