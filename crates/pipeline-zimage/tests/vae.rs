//! The FLUX-structured VAE against diffusers' `AutoencoderKL` on the tiny checkpoint
//! (`fixtures/golden/vae.safetensors` and the pipeline goldens, made by `tools/make_fixtures.py`).
//! Tolerance: 1e-4 max abs, f32 on `Device::flex()`.

use std::path::PathBuf;

use burn::module::Module;
use burn::tensor::{Device, Tensor, TensorData};
use pipeline_zimage::Error;
use pipeline_zimage::loading::LoadOptions;
use pipeline_zimage::vae::{AutoencoderKl, VaeConfig};
use safetensors::SafeTensors;

const TOL: f32 = 1e-4;

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

/// Reads golden f32 tensor `name` of `file` as a burn tensor on `device`.
fn golden<const D: usize>(file: &str, name: &str, device: &Device) -> Tensor<D> {
    let bytes = std::fs::read(fixtures().join("golden").join(file)).expect("read golden");
    let st = SafeTensors::deserialize(&bytes).expect("safetensors");
    let view = st.tensor(name).expect("tensor");
    let values: Vec<f32> = view.data().chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
    Tensor::from_data(TensorData::new(values, view.shape().to_vec()), device)
}

/// Asserts `got` and `want` have one shape and differ by at most [`TOL`]; returns the error.
fn check<const D: usize>(what: &str, got: Tensor<D>, want: Tensor<D>) -> f32 {
    assert_eq!(got.dims(), want.dims(), "{what}: shape");
    let err = (got - want).abs().max().into_scalar();
    println!("{what}: max abs error {err:e}");
    assert!(err <= TOL, "{what}: max abs error {err} > {TOL}");
    err
}

fn load() -> (VaeConfig, AutoencoderKl) {
    let (config, vae, report) =
        AutoencoderKl::load(fixtures().join("tiny-z-image-turbo/vae"), &Device::flex(), &LoadOptions::default())
            .expect("load vae");
    assert!(report.is_complete(), "{report}");
    (config, vae)
}

#[test]
fn decode_matches_diffusers() {
    let device = Device::flex();
    let (_, vae) = load();
    let z = golden::<4>("vae.safetensors", "latents", &device);
    check("decode", vae.decode(z), golden("vae.safetensors", "decoded", &device));
}

#[test]
fn encode_mean_matches_diffusers() {
    let device = Device::flex();
    let (_, vae) = load();
    let image = golden::<4>("vae.safetensors", "image", &device);
    check("encode_mean", vae.encode_mean(image), golden("vae.safetensors", "latent_mean", &device));
}

#[test]
fn img2img_image_latents_match_the_pipeline() {
    let device = Device::flex();
    let (_, vae) = load();
    let init = golden::<4>("pipeline_img2img.safetensors", "init_image", &device);
    let latents = vae.scale_latents(vae.encode_mean(init * 2.0 - 1.0));
    check("img2img image_latents", latents, golden("pipeline_img2img.safetensors", "image_latents", &device));
}

#[test]
fn final_decode_of_the_turbo_pipeline_matches() {
    let device = Device::flex();
    let (_, vae) = load();
    let steps = golden::<4>("pipeline_t2i_turbo.safetensors", "step_latents", &device);
    let n = steps.dims()[0];
    let last = steps.narrow(0, n - 1, 1);
    let image = AutoencoderKl::postprocess(vae.decode(vae.unscale_latents(last)));
    check("turbo image", image, golden("pipeline_t2i_turbo.safetensors", "image", &device));
}

#[test]
fn checkpoint_holds_what_the_config_counts() {
    let (config, vae) = load();
    assert_eq!(config.scale_factor(), 8);
    assert_eq!(vae.num_params(), config.num_params());
    assert_eq!(vae.decoder.num_params(), config.decoder_params());
}

#[test]
fn z_image_turbo_preset_sizes() {
    let c = VaeConfig::z_image_turbo();
    assert_eq!(c.num_params(), 83_819_683);
    assert_eq!(c.decoder_params(), 49_545_475);
}

#[test]
fn a_missing_directory_is_reported() {
    let err = AutoencoderKl::load(fixtures().join("no-such-vae"), &Device::flex(), &LoadOptions::default())
        .expect_err("must fail");
    assert!(matches!(err, Error::MissingDirectory { .. }), "{err}");
}
