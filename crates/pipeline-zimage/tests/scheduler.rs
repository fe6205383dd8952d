//! Parity of the flow-match Euler scheduler with diffusers' `FlowMatchEulerDiscreteScheduler`
//! (golden values in `fixtures/golden/scheduler.json`, made by `tools/make_fixtures.py`).

use std::path::PathBuf;

use burn::tensor::{Device, Tensor, TensorData};
use pipeline_zimage::scheduler::{Schedule, SchedulerConfig};
use serde_json::Value;

/// Tolerance on every value (timesteps are ~1000 in f32, so this is a few ulps there).
const TOL: f32 = 1e-4;

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

fn golden() -> Value {
    let text = std::fs::read_to_string(fixtures().join("golden/scheduler.json")).expect("read scheduler.json");
    serde_json::from_str(&text).expect("parse scheduler.json")
}

fn floats(v: &Value) -> Vec<f32> {
    v.as_array().expect("array").iter().map(|x| x.as_f64().expect("number") as f32).collect()
}

fn check(what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let err = got.iter().zip(want).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
    println!("{what}: max abs error {err:e}");
    assert!(err <= TOL, "{what}: max abs error {err} > {TOL}\n got {got:?}\nwant {want:?}");
}

fn config() -> SchedulerConfig {
    SchedulerConfig::from_file(fixtures().join("tiny-z-image-turbo/scheduler/scheduler_config.json"))
        .expect("scheduler config")
}

fn schedule(n: usize) -> Schedule {
    // 64x64 pixels -> 8x8 latent -> 16 image tokens (ignored with static shifting).
    config().schedule(n, 16).expect("schedule")
}

fn vector(values: &[f32]) -> Tensor<1> {
    Tensor::from_data(TensorData::new(values.to_vec(), [values.len()]), &Device::flex())
}

#[test]
fn fixture_config_is_the_turbo_preset() {
    assert_eq!(config(), SchedulerConfig::z_image_turbo());
}

#[test]
fn set_timesteps_matches_diffusers() {
    for case in golden()["set_timesteps"].as_array().expect("cases") {
        let n = case["num_inference_steps"].as_u64().expect("n") as usize;
        let s = schedule(n);
        check(&format!("sigmas N={n}"), &s.sigmas, &floats(&case["sigmas"]));
        check(&format!("timesteps N={n}"), &s.timesteps, &floats(&case["timesteps"]));
    }
}

#[test]
fn img2img_truncation_matches_diffusers() {
    for case in golden()["img2img"].as_array().expect("cases") {
        let n = case["num_inference_steps"].as_u64().expect("n") as usize;
        let strength = case["strength"].as_f64().expect("strength");
        let s = schedule(n).img2img(strength).expect("img2img");
        check(&format!("img2img timesteps N={n}"), &s.timesteps, &floats(&case["timesteps"]));
        check(&format!("img2img sigmas N={n}"), &s.sigmas, &floats(&case["sigmas"]));
    }
}

#[test]
fn euler_step_matches_diffusers() {
    let case = &golden()["step"];
    let s = schedule(case["num_inference_steps"].as_u64().expect("n") as usize);
    let i = case["step_index"].as_u64().expect("i") as usize;
    let out = s.step(vector(&floats(&case["model_output"])), vector(&floats(&case["sample"])), i);
    let got = out.into_data().try_into_vec::<f32>().expect("f32");
    check("step", &got, &floats(&case["prev_sample"]));
}

#[test]
fn scale_noise_matches_diffusers() {
    let case = &golden()["scale_noise"];
    let s = schedule(case["num_inference_steps"].as_u64().expect("n") as usize);
    // diffusers noises to sigmas[begin_index]; the truncated schedule starts there.
    let i = case["step_index"].as_u64().expect("i") as usize;
    let truncated = Schedule {
        sigmas: s.sigmas[i..].to_vec(),
        timesteps: s.timesteps[i..].to_vec(),
        num_train_timesteps: s.num_train_timesteps,
    };
    let out = truncated.scale_noise(vector(&floats(&case["sample"])), vector(&floats(&case["noise"])));
    let got = out.into_data().try_into_vec::<f32>().expect("f32");
    check("scale_noise", &got, &floats(&case["noised"]));
}

#[test]
fn model_time_is_one_minus_sigma() {
    let s = schedule(4);
    for i in 0..s.len() {
        assert!((s.model_time(i) - (1.0 - s.sigmas[i])).abs() < 1e-6);
    }
}
