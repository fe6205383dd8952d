//! The flow-matching Euler scheduler (diffusers `FlowMatchEulerDiscreteScheduler`) as the Z-Image pipelines use it.
//!
//! The schedule is plain numbers ([`Schedule`]): the sigmas and timesteps are computed on the host in `f32` with
//! the same operation order as diffusers (numpy `float32`), so they match it to the last bit or two. Only
//! [`Schedule::step`] and [`Schedule::scale_noise`] touch tensors, and they compute in `f32` whatever the input dtype.
//!
//! The Z-Image pipelines call `set_timesteps(sigmas = linspace(1, 1/N, N), mu)`; with the shipped config
//! (`use_dynamic_shifting: false`, `shift: 3.0`) `mu` is ignored and every sigma is shifted statically,
//! `s' = shift·s / (1 + (shift − 1)·s)`, a terminal `0` is appended, and `timesteps = s'·1000`.

use std::path::Path;

use burn::tensor::{DType, Tensor};
use serde::Deserialize;

use crate::{Error, Result};

/// `scheduler/scheduler_config.json`: the fields of `FlowMatchEulerDiscreteScheduler` this crate uses.
///
/// Unknown fields are ignored; fields the file omits take diffusers' defaults. The schedule-reshaping options
/// (`shift_terminal`, Karras / exponential / beta sigmas, `invert_sigmas`, stochastic sampling) are read so that
/// [`SchedulerConfig::validate`] can refuse a config that sets them instead of silently ignoring them.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default)]
pub struct SchedulerConfig {
    /// The number of training timesteps; timesteps are `sigma * num_train_timesteps`.
    pub num_train_timesteps: usize,
    /// The static shift applied when `use_dynamic_shifting` is false.
    pub shift: f64,
    /// Whether the shift depends on the image size (`mu`) instead of `shift`.
    pub use_dynamic_shifting: bool,
    /// Image token count at which `mu = base_shift` (dynamic shifting only).
    pub base_image_seq_len: usize,
    /// Image token count at which `mu = max_shift` (dynamic shifting only).
    pub max_image_seq_len: usize,
    /// `mu` at `base_image_seq_len` (dynamic shifting only).
    pub base_shift: f64,
    /// `mu` at `max_image_seq_len` (dynamic shifting only).
    pub max_shift: f64,
    /// `"exponential"` or `"linear"` (dynamic shifting only).
    pub time_shift_type: String,
    /// Unsupported when set: stretches the schedule to end at this sigma.
    pub shift_terminal: Option<f64>,
    /// Unsupported when true.
    pub use_karras_sigmas: bool,
    /// Unsupported when true.
    pub use_exponential_sigmas: bool,
    /// Unsupported when true.
    pub use_beta_sigmas: bool,
    /// Unsupported when true.
    pub invert_sigmas: bool,
    /// Unsupported when true.
    pub stochastic_sampling: bool,
}

impl Default for SchedulerConfig {
    /// diffusers' constructor defaults (shift 1.0: no shifting).
    fn default() -> Self {
        Self {
            num_train_timesteps: 1000,
            shift: 1.0,
            use_dynamic_shifting: false,
            base_image_seq_len: 256,
            max_image_seq_len: 4096,
            base_shift: 0.5,
            max_shift: 1.15,
            time_shift_type: "exponential".to_owned(),
            shift_terminal: None,
            use_karras_sigmas: false,
            use_exponential_sigmas: false,
            use_beta_sigmas: false,
            invert_sigmas: false,
            stochastic_sampling: false,
        }
    }
}

impl SchedulerConfig {
    /// The config shipped with Tongyi-MAI/Z-Image-Turbo: 1000 training steps, static shift 3.0.
    pub fn z_image_turbo() -> Self {
        Self { shift: 3.0, ..Self::default() }
    }

    /// Reads and validates `scheduler_config.json`.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        Self::parse(&crate::config::read_text(path)?, path)
    }

    /// Parses and validates the text of the file; `path` is only used in errors.
    pub fn parse(text: &str, path: &Path) -> Result<Self> {
        crate::config::parse_json(text, path, Self::validate)
    }

    /// Checks that the config only uses what this implementation supports; the `Err` says what is not.
    pub fn validate(&self) -> std::result::Result<(), String> {
        let unsupported = [
            (self.shift_terminal.is_some(), "shift_terminal"),
            (self.use_karras_sigmas, "use_karras_sigmas"),
            (self.use_exponential_sigmas, "use_exponential_sigmas"),
            (self.use_beta_sigmas, "use_beta_sigmas"),
            (self.invert_sigmas, "invert_sigmas"),
            (self.stochastic_sampling, "stochastic_sampling"),
        ];
        if let Some((_, name)) = unsupported.iter().find(|(set, _)| *set) {
            return Err(format!("scheduler option {name} is not supported"));
        }
        if self.num_train_timesteps == 0 {
            return Err("num_train_timesteps must be positive".to_owned());
        }
        if !(self.shift.is_finite() && self.shift > 0.0) {
            return Err(format!("shift must be positive, got {}", self.shift));
        }
        if self.use_dynamic_shifting && !matches!(self.time_shift_type.as_str(), "exponential" | "linear") {
            return Err(format!("unknown time_shift_type {:?}", self.time_shift_type));
        }
        Ok(())
    }

    /// `mu` for an image of `image_seq_len` tokens: the line through `(base_image_seq_len, base_shift)` and
    /// `(max_image_seq_len, max_shift)` (diffusers `calculate_shift`). Only used with dynamic shifting.
    pub fn mu(&self, image_seq_len: usize) -> f64 {
        let (x1, x2) = (self.base_image_seq_len as f64, self.max_image_seq_len as f64);
        let m = (self.max_shift - self.base_shift) / (x2 - x1);
        let b = self.base_shift - m * x1;
        image_seq_len as f64 * m + b
    }

    /// The text-to-image schedule for `num_inference_steps` steps, as the Z-Image pipeline sets it:
    /// `sigmas = linspace(1, 1/N, N)`, shifted, plus a terminal 0.
    ///
    /// `image_seq_len` (patch tokens of the latent, `(h/2)·(w/2)`) only matters with dynamic shifting.
    pub fn schedule(&self, num_inference_steps: usize, image_seq_len: usize) -> Result<Schedule> {
        if num_inference_steps == 0 {
            return Err(Error::ZeroSteps);
        }
        let n = num_inference_steps;
        let mu = self.mu(image_seq_len) as f32;
        let shift = self.shift as f32;
        let mut sigmas: Vec<f32> = linspace_f32(1.0, 1.0 / n as f64, n)
            .into_iter()
            .map(|s| {
                if self.use_dynamic_shifting {
                    time_shift(&self.time_shift_type, mu, s)
                } else {
                    // numpy float32: shift * s / (1 + (shift - 1) * s), evaluated in this order.
                    shift * s / (1.0 + (shift - 1.0) * s)
                }
            })
            .collect();
        let timesteps = sigmas.iter().map(|s| s * self.num_train_timesteps as f32).collect();
        sigmas.push(0.0);
        Ok(Schedule { sigmas, timesteps, num_train_timesteps: self.num_train_timesteps })
    }
}

/// diffusers `time_shift`: `exponential` `e^mu / (e^mu + (1/t − 1))`, `linear` `mu / (mu + (1/t − 1))` (sigma 1).
fn time_shift(kind: &str, mu: f32, t: f32) -> f32 {
    let tail = 1.0 / t - 1.0;
    if kind == "linear" { mu / (mu + tail) } else { mu.exp() / (mu.exp() + tail) }
}

/// `torch.linspace(start, end, n)` in float32: the first half counts up from `start`, the second half down from
/// `end` (symmetric, so both ends are exact), then rounds to `f32`.
fn linspace_f32(start: f64, end: f64, n: usize) -> Vec<f32> {
    if n == 1 {
        return vec![start as f32];
    }
    let step = (end - start) / (n - 1) as f64;
    let halfway = n / 2;
    (0..n)
        .map(|i| if i < halfway { start + step * i as f64 } else { end - step * (n - 1 - i) as f64 })
        .map(|v| v as f32)
        .collect()
}

/// A denoising schedule: what `set_timesteps` (and, for img2img, `get_timesteps`) leave in the scheduler.
///
/// Step `i` goes from `sigmas[i]` to `sigmas[i + 1]`; `timesteps[i] = sigmas[i] · num_train_timesteps`, and the
/// transformer is fed `1 − sigmas[i]` (= `(1000 − t)/1000`).
#[derive(Debug, Clone, PartialEq)]
pub struct Schedule {
    /// `N + 1` sigmas, decreasing, the last one the terminal `0`.
    pub sigmas: Vec<f32>,
    /// `N` timesteps, `sigmas[i] · num_train_timesteps`.
    pub timesteps: Vec<f32>,
    /// The training timestep count the timesteps are scaled by.
    pub num_train_timesteps: usize,
}

impl Schedule {
    /// The number of denoising steps, `N`.
    pub fn len(&self) -> usize {
        self.timesteps.len()
    }

    /// Whether the schedule has no step.
    pub fn is_empty(&self) -> bool {
        self.timesteps.is_empty()
    }

    /// The transformer's time input at step `i`: `(num_train_timesteps − timesteps[i]) / num_train_timesteps`.
    ///
    /// Panics if `i >= len()`.
    pub fn model_time(&self, i: usize) -> f32 {
        let t_max = self.num_train_timesteps as f32;
        (t_max - self.timesteps[i]) / t_max
    }

    /// The image-to-image schedule: drops the first `N − int(N·strength)` steps (diffusers `get_timesteps`).
    ///
    /// The first remaining sigma is the noise level [`Schedule::scale_noise`] must be called with.
    /// Errors on a strength outside `[0, 1]` and when no step would remain.
    pub fn img2img(&self, strength: f64) -> Result<Schedule> {
        if !(0.0..=1.0).contains(&strength) {
            return Err(Error::InvalidStrength { strength });
        }
        let n = self.len() as f64;
        let init_timestep = (n * strength).min(n);
        let t_start = (n - init_timestep).max(0.0) as usize;
        if t_start >= self.len() {
            return Err(Error::ZeroSteps);
        }
        Ok(Schedule {
            sigmas: self.sigmas[t_start..].to_vec(),
            timesteps: self.timesteps[t_start..].to_vec(),
            num_train_timesteps: self.num_train_timesteps,
        })
    }

    /// One Euler step from `sigmas[i]` to `sigmas[i + 1]`:
    /// `sample + (sigmas[i + 1] − sigmas[i]) · model_output`, in `f32`.
    ///
    /// `model_output` is the velocity (`noise − x0`; the Z-Image pipeline passes the negated transformer output).
    /// Shapes: any, equal for both; the result is `f32`. Panics if `i >= len()`.
    pub fn step<const D: usize>(&self, model_output: Tensor<D>, sample: Tensor<D>, i: usize) -> Tensor<D> {
        let dt = self.sigmas[i + 1] - self.sigmas[i];
        sample.cast(DType::F32) + model_output.cast(DType::F32) * dt
    }

    /// Noises a clean sample to the first sigma of this schedule: `sigma · noise + (1 − sigma) · sample`, in `f32`
    /// (diffusers `scale_noise` with the begin index set, as img2img calls it on the truncated schedule).
    ///
    /// Shapes: any, equal for both. Panics on an empty schedule.
    pub fn scale_noise<const D: usize>(&self, sample: Tensor<D>, noise: Tensor<D>) -> Tensor<D> {
        let sigma = self.sigmas[0];
        noise.cast(DType::F32) * sigma + sample.cast(DType::F32) * (1.0 - sigma)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn turbo_eight_steps_match_the_reference_table() {
        let s = SchedulerConfig::z_image_turbo().schedule(8, 4096).expect("schedule");
        let expect = [1.0, 0.954_545, 0.9, 0.833_333, 0.75, 0.642_857, 0.5, 0.3, 0.0];
        for (got, want) in s.sigmas.iter().zip(expect) {
            assert!((got - want).abs() < 1e-5, "{got} vs {want}");
        }
    }

    #[test]
    fn zero_steps_and_bad_strength_are_errors() {
        let config = SchedulerConfig::z_image_turbo();
        assert!(matches!(config.schedule(0, 16), Err(Error::ZeroSteps)));
        let s = config.schedule(4, 16).expect("schedule");
        assert!(matches!(s.img2img(1.5), Err(Error::InvalidStrength { .. })));
        assert!(matches!(s.img2img(0.0), Err(Error::ZeroSteps)));
        assert_eq!(s.img2img(0.6).expect("img2img").len(), 3);
    }
}
