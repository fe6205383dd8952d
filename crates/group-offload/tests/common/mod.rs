//! The mock device (memory-sim's `SimCard`, hard, named `cuda:0`) and a small model: a six-block MLP.

#![allow(dead_code)] // Each test binary uses a different subset of these helpers.

use std::sync::Arc;
use std::time::Duration;

use burn::module::Module;
use burn::nn::{LayerNorm, LayerNormConfig, Linear, LinearConfig};
use burn::tensor::activation::gelu;
use burn::tensor::{Device, Distribution, Tensor};
use memory_sim::{CardSpec, Faults, Mode, SimCard, Timing};

/// A hard simulated card of `capacity` bytes with no context overhead, named `cuda:0`: the one mock device.
pub fn hard_card(capacity: u64) -> Arc<SimCard> {
    let spec = CardSpec::parse(&capacity.to_string()).expect("a size").with_mode(Mode::Hard).with_context_overhead(0);
    SimCard::new(spec)
}

/// [`hard_card`] whose every transfer takes `per_transfer` of wall time (a slow link), so a prefetch overlaps compute.
pub fn slow_card(capacity: u64, per_transfer: Duration) -> Arc<SimCard> {
    let timing = Timing { link_bytes_per_second: f64::INFINITY, link_latency: per_transfer, ..Timing::GENERIC };
    let spec = CardSpec::parse(&capacity.to_string())
        .expect("a size")
        .with_mode(Mode::Hard)
        .with_context_overhead(0)
        .with_timing(timing);
    let card = SimCard::new(spec);
    card.set_faults(Faults { real_time_scale: Some(1.0), ..Faults::default() });
    card
}

/// Fails the card's allocation with this ordinal (counted from its creation), once.
pub fn fail_allocation(card: &SimCard, ordinal: u64) {
    card.set_faults(Faults { fail_allocation: Some(ordinal), ..Faults::default() });
}

/// Fails the card's transfer with this ordinal (counted from its creation), once.
pub fn fail_transfer(card: &SimCard, ordinal: u64) {
    card.set_faults(Faults { fail_transfer: Some(ordinal), ..Faults::default() });
}

pub const DIM: usize = 16;
pub const HIDDEN: usize = 32;
pub const BLOCKS: usize = 6;

/// A pre-norm MLP block: `x + fc2(gelu(fc1(norm(x))))`.
#[derive(Module, Debug)]
pub struct Block {
    pub norm: LayerNorm,
    pub fc1: Linear,
    pub fc2: Linear,
}

impl Block {
    pub fn new(device: &Device) -> Self {
        Self {
            norm: LayerNormConfig::new(DIM).init(device),
            fc1: LinearConfig::new(DIM, HIDDEN).init(device),
            fc2: LinearConfig::new(HIDDEN, DIM).init(device),
        }
    }

    pub fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        let h = self.fc2.forward(gelu(self.fc1.forward(self.norm.forward(x.clone()))));
        x + h
    }
}

/// The layers outside the blocks.
#[derive(Module, Debug)]
pub struct Top {
    pub pre: Linear,
    pub post: Linear,
}

/// Six blocks between a pre and a post layer.
#[derive(Module, Debug)]
pub struct Model {
    pub pre: Linear,
    pub blocks: Vec<Block>,
    pub post: Linear,
}

impl Model {
    pub fn new(device: &Device) -> Self {
        device.seed(7);
        Self {
            pre: LinearConfig::new(DIM, DIM).init(device),
            blocks: (0..BLOCKS).map(|_| Block::new(device)).collect(),
            post: LinearConfig::new(DIM, DIM).init(device),
        }
    }

    pub fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        let mut x = self.pre.forward(x);
        for block in &self.blocks {
            x = block.forward(x);
        }
        self.post.forward(x)
    }

    /// Splits into the top-level layers and the blocks.
    pub fn split(self) -> (Top, Vec<Block>) {
        (Top { pre: self.pre, post: self.post }, self.blocks)
    }
}

pub fn input(device: &Device) -> Tensor<2> {
    device.seed(11);
    Tensor::<2>::random([4, DIM], Distribution::Normal(0.0, 1.0), device)
}

pub fn max_abs_diff(a: &Tensor<2>, b: &Tensor<2>) -> f32 {
    let a = a.to_data().try_to_vec::<f32>().unwrap();
    let b = b.to_data().try_to_vec::<f32>().unwrap();
    assert_eq!(a.len(), b.len());
    a.iter().zip(&b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}
