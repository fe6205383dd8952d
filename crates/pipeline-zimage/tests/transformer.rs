//! Parity of `ZImageTransformer2DModel` with diffusers on the tiny checkpoint (golden values from
//! `tools/make_fixtures.py`), on the CPU `flex` backend.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use burn::module::Module;
use burn::tensor::{DType, Device, Tensor, TensorData};
use pipeline_zimage::config::TransformerConfig;
use pipeline_zimage::loading::{Checkpoint, LoadOptions};
use pipeline_zimage::transformer::{ZImageTransformer2DModel, block_forward};

/// The largest absolute error accepted against diffusers in f32.
const F32_TOLERANCE: f32 = 1e-4;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

/// A golden tensor: PyTorch-order shape and f32 values.
struct Golden {
    shape: Vec<usize>,
    values: Vec<f32>,
}

fn read_golden(name: &str) -> HashMap<String, Golden> {
    let bytes = std::fs::read(fixtures().join("golden").join(name)).expect("golden file exists");
    let file = safetensors::SafeTensors::deserialize(&bytes).expect("golden file parses");
    file.tensors()
        .into_iter()
        .filter(|(_, view)| view.dtype() == safetensors::Dtype::F32)
        .map(|(name, view)| {
            let values = view.data().chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
            let golden = Golden { shape: view.shape().to_vec(), values };
            (name, golden)
        })
        .collect()
}

fn tensor<const D: usize>(golden: &Golden, device: &Device) -> Tensor<D> {
    Tensor::from_data(TensorData::new(golden.values.clone(), golden.shape.clone()), (device, DType::F32))
}

fn values<const D: usize>(t: Tensor<D>) -> Vec<f32> {
    t.cast(DType::F32).into_data().try_into_vec::<f32>().expect("f32 data")
}

fn max_abs_error(got: &[f32], expected: &[f32]) -> f32 {
    assert_eq!(got.len(), expected.len(), "element counts differ");
    got.iter().zip(expected).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max)
}

fn load(dtype: DType) -> ZImageTransformer2DModel {
    let checkpoint = Checkpoint::open(fixtures().join("tiny-z-image-turbo")).expect("tiny checkpoint opens");
    let (model, report) = checkpoint
        .load_transformer(&Device::flex(), &LoadOptions::new().with_dtype(Some(dtype)))
        .expect("tiny transformer loads");
    assert!(report.is_complete(), "{report}");
    model
}

#[test]
fn module_tree_matches_the_config_sizes() {
    let config = TransformerConfig::from_file(&fixtures().join("tiny-z-image-turbo/transformer/config.json"))
        .expect("config parses");
    let model = ZImageTransformer2DModel::new(&config, &Device::flex());
    assert_eq!(model.num_params(), config.num_params());
    assert_eq!(model.layers[0].num_params(), config.modulated_block_params());
    assert_eq!(model.context_refiner[0].num_params(), config.context_block_params());
}

#[test]
fn forward_matches_diffusers_in_f32() {
    let device = Device::flex();
    let model = load(DType::F32);
    let golden = read_golden("transformer.safetensors");
    let x: Tensor<4> = tensor(&golden["x"], &device);
    let t: Tensor<1> = tensor(&golden["t"], &device);
    let cap: Tensor<2> = tensor(&golden["cap_feats"], &device);

    let out = model.forward(x.unsqueeze_dim(0), t, cap.unsqueeze_dim(0));
    assert_eq!(out.dims().to_vec()[1..], golden["out"].shape[..]);
    let error = max_abs_error(&values(out), &golden["out"].values);
    println!("transformer f32 max abs error: {error:e}");
    assert!(error <= F32_TOLERANCE, "max abs error {error:e} > {F32_TOLERANCE:e}");
}

#[test]
fn block_by_block_equals_forward() {
    let device = Device::flex();
    let model = load(DType::F32);
    let golden = read_golden("transformer.safetensors");
    let x: Tensor<5> = tensor::<4>(&golden["x"], &device).unsqueeze_dim(0);
    let t: Tensor<1> = tensor(&golden["t"], &device);
    let cap: Tensor<3> = tensor::<2>(&golden["cap_feats"], &device).unsqueeze_dim(0);

    let whole = values(model.forward(x.clone(), t.clone(), cap.clone()));
    let mut state = model.prepare(x, t, cap);
    assert_eq!(state.layout.image_tokens, 24);
    assert_eq!(state.hidden.dims(), [1, 32 + 32, 64]);
    for block in &model.layers {
        state = block_forward(block, state);
    }
    let stepped = values(model.finish(state));
    assert_eq!(max_abs_error(&stepped, &whole), 0.0);
}

#[test]
fn items_of_different_lengths_match_the_masked_batch() {
    let device = Device::flex();
    let model = load(DType::F32);
    let golden = read_golden("transformer_batch2.safetensors");
    let xs = vec![tensor(&golden["x_0"], &device), tensor(&golden["x_1"], &device)];
    let caps = vec![tensor(&golden["cap_feats_0"], &device), tensor(&golden["cap_feats_1"], &device)];
    let outs = model.forward_items(xs, tensor(&golden["t"], &device), caps);
    for (i, out) in outs.into_iter().enumerate() {
        let expected = &golden[&format!("out_{i}")];
        let error = max_abs_error(&values(out), &expected.values);
        println!("item {i} max abs error: {error:e}");
        assert!(error <= F32_TOLERANCE, "item {i}: max abs error {error:e}");
    }
}

#[test]
fn bf16_forward_stays_close() {
    let device = Device::flex();
    let model = load(DType::BF16);
    assert_eq!(model.dtype(), DType::BF16);
    let golden = read_golden("transformer.safetensors");
    let x: Tensor<4> = tensor(&golden["x"], &device);
    let t: Tensor<1> = tensor(&golden["t"], &device);
    let cap: Tensor<2> = tensor(&golden["cap_feats"], &device);

    let out = model.forward(x.unsqueeze_dim(0), t, cap.unsqueeze_dim(0));
    assert_eq!(out.dtype(), DType::BF16);
    let expected = &golden["out"].values;
    let error = max_abs_error(&values(out), expected);
    let scale = expected.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    println!("transformer bf16 max abs error: {error:e} (output scale {scale:e})");
    // bf16 keeps 8 mantissa bits; after a few blocks a few percent of the output scale is expected.
    assert!(error <= 0.05 * scale.max(1.0), "bf16 max abs error {error:e}");
}

#[test]
fn check_inputs_rejects_what_the_model_cannot_run() {
    let model = load(DType::F32);
    assert!(model.check_inputs([1, 16, 1, 8, 12], 13).is_ok());
    let shape_error = |r: pipeline_zimage::Result<()>| matches!(r, Err(pipeline_zimage::Error::Shape { .. }));
    // Odd latent height: not a whole number of 2x2 patches.
    assert!(shape_error(model.check_inputs([1, 16, 1, 7, 12], 13)));
    // Wrong channel count.
    assert!(shape_error(model.check_inputs([1, 4, 1, 8, 12], 13)));
    // The tiny config's caption axis has 128 positions: 128 caption tokens plus the image frame do not fit.
    assert!(shape_error(model.check_inputs([1, 16, 1, 8, 12], 128)));
    // Its height axis has 32 positions: a 66-pixel-high latent needs 33.
    assert!(shape_error(model.check_inputs([1, 16, 1, 66, 12], 13)));
}
