//! Presets: named bundles of routing and budget defaults, parsed from strings with a typed error.

use std::fmt;

use crate::plan::error::PlanError;

/// A named policy for routing every component of a pipeline.
///
/// ```
/// use offload_core::plan::Preset;
/// assert_eq!("one_shot_fast".parse::<Preset>()?, Preset::OneShotFast);
/// assert_eq!("Diffusers-Offload-Compat".parse::<Preset>()?, Preset::DiffusersOffloadCompat);
/// let err = "fast".parse::<Preset>().unwrap_err().to_string();
/// assert!(err.contains("auto, one_shot_fast, low_ram_safe"), "{err}");
/// # Ok::<(), offload_core::plan::PlanError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Preset {
    /// Decide per component from the machine: the route with the shortest predicted time that fits.
    #[default]
    Auto,
    /// One image, as fast as possible: components that fit move whole, the others stream by blocks with the
    /// largest resident budget; weights streamed every step are pinned.
    OneShotFast,
    /// Least device and host pressure: nothing resident beyond what a route needs, nothing pinned.
    LowRamSafe,
    /// Servers generating many images: like `one_shot_fast`, and every streamed host copy is pinned for the
    /// life of the process.
    WarmProcess,
    /// diffusers' `block_level` group offload: one block per group, prefetch, no resident budget.
    DiffusersOffloadCompat,
    /// diffusers' `leaf_level` group offload with a stream.
    DiffusersLeafOffloadCompat,
    /// No pinned memory and no prefetch thread (what DDO's `wsl_compat` does on Linux).
    NoPin,
    /// No routing: the caller places every component.
    Off,
}

/// The accepted preset names, in the order they are documented.
pub const PRESET_NAMES: &str = "auto, one_shot_fast, low_ram_safe, warm_process, diffusers_offload_compat, diffusers_leaf_offload_compat, no_pin, off";

impl Preset {
    /// Every preset, in the order they are documented.
    pub const ALL: [Preset; 8] = [
        Preset::Auto,
        Preset::OneShotFast,
        Preset::LowRamSafe,
        Preset::WarmProcess,
        Preset::DiffusersOffloadCompat,
        Preset::DiffusersLeafOffloadCompat,
        Preset::NoPin,
        Preset::Off,
    ];

    /// The preset's name, as parsed and printed.
    pub fn name(self) -> &'static str {
        match self {
            Preset::Auto => "auto",
            Preset::OneShotFast => "one_shot_fast",
            Preset::LowRamSafe => "low_ram_safe",
            Preset::WarmProcess => "warm_process",
            Preset::DiffusersOffloadCompat => "diffusers_offload_compat",
            Preset::DiffusersLeafOffloadCompat => "diffusers_leaf_offload_compat",
            Preset::NoPin => "no_pin",
            Preset::Off => "off",
        }
    }

    /// Parses a preset name; case-insensitive, `-` read as `_`.
    pub fn parse(input: &str) -> Result<Self, PlanError> {
        let normal = input.trim().to_ascii_lowercase().replace('-', "_");
        Self::ALL
            .into_iter()
            .find(|preset| preset.name() == normal)
            .ok_or_else(|| PlanError::UnknownPreset { input: input.to_string(), accepted: PRESET_NAMES })
    }

    /// The defaults the preset gives every setting nobody set.
    pub fn defaults(self) -> PresetDefaults {
        let base = PresetDefaults {
            routing: Routing::FitOrBlock,
            whole_pipeline_resident: true,
            prefetch: true,
            prefetch_depth: 1,
            blocks_per_group: 1,
            resident: ResidentPolicy::Fill,
            pin: PinPolicy::Never,
            full_pin_rule: false,
            low_host_memory: false,
        };
        match self {
            Preset::Auto => PresetDefaults { routing: Routing::Fastest, pin: PinPolicy::WhenItPays, ..base },
            Preset::OneShotFast => PresetDefaults { pin: PinPolicy::Repeated, full_pin_rule: true, ..base },
            Preset::LowRamSafe => PresetDefaults {
                whole_pipeline_resident: false,
                resident: ResidentPolicy::Zero,
                low_host_memory: true,
                ..base
            },
            Preset::WarmProcess => PresetDefaults { pin: PinPolicy::All, full_pin_rule: true, ..base },
            Preset::DiffusersOffloadCompat => PresetDefaults {
                routing: Routing::Block,
                whole_pipeline_resident: false,
                resident: ResidentPolicy::Zero,
                ..base
            },
            Preset::DiffusersLeafOffloadCompat => PresetDefaults {
                routing: Routing::Leaf,
                whole_pipeline_resident: false,
                resident: ResidentPolicy::Zero,
                ..base
            },
            Preset::NoPin => PresetDefaults { prefetch: false, ..base },
            Preset::Off => PresetDefaults { routing: Routing::Off, whole_pipeline_resident: false, ..base },
        }
    }

    /// One line on what the preset routes where.
    pub fn routes(self) -> &'static str {
        match self {
            Preset::Auto => {
                "everything resident when it fits; otherwise per component the route with the shortest predicted \
                 time that fits beside its activations (component, block or leaf offload)"
            }
            Preset::OneShotFast => {
                "everything resident when it fits; a component that fits moves whole; one that does not streams by \
                 blocks with the largest resident budget; streamed-every-step weights pinned; full pin, nothing \
                 resident, at 4x the card"
            }
            Preset::LowRamSafe => {
                "components that fit move whole; the rest stream by blocks with no resident budget; nothing pinned; \
                 every host copy a checkpoint file or the disk store can serve is read from it, not kept in RAM"
            }
            Preset::WarmProcess => {
                "as one_shot_fast, and every streamed host copy is pinned for the life of the process"
            }
            Preset::DiffusersOffloadCompat => {
                "every component with blocks streams one block per group with prefetch; no resident budget, no pin"
            }
            Preset::DiffusersLeafOffloadCompat => {
                "every group-offloadable component streams leaf by leaf with prefetch; no pin"
            }
            Preset::NoPin => "as one_shot_fast without pinned memory and without the prefetch thread",
            Preset::Off => "nothing: the caller places every component",
        }
    }

    /// One line on when to use the preset.
    pub fn when(self) -> &'static str {
        match self {
            Preset::Auto => "the default; read its plan to see why",
            Preset::OneShotFast => "one image per process with enough host RAM to pin the streamed weights",
            Preset::LowRamSafe => "host RAM or device memory is tight, or another program shares the card",
            Preset::WarmProcess => "servers and notebooks that generate many images in one process",
            Preset::DiffusersOffloadCompat => "a baseline to compare with diffusers' block-level group offload",
            Preset::DiffusersLeafOffloadCompat => {
                "a baseline to compare with diffusers' leaf-level group offload; the smallest device footprint"
            }
            Preset::NoPin => "pinned memory or a second thread is unstable on the platform (WSL, some drivers)",
            Preset::Off => "the program manages devices itself",
        }
    }
}

/// The documentation's preset table, in Markdown: preset, what it routes where, when to use it.
pub fn presets_table() -> String {
    let mut out = String::from("| preset | routes | use it when |\n|---|---|---|\n");
    for preset in Preset::ALL {
        out.push_str(&format!("| `{}` | {} | {} |\n", preset.name(), preset.routes(), preset.when()));
    }
    out
}

impl fmt::Display for Preset {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.pad(self.name())
    }
}

impl std::str::FromStr for Preset {
    type Err = PlanError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::parse(s)
    }
}

/// How a preset chooses each component's route.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Routing {
    /// Among the routes that fit, the one with the shortest predicted time per image (`auto`).
    Fastest,
    /// Component offload when the component fits whole beside its activations, block offload otherwise, leaf
    /// offload when blocks do not fit either.
    FitOrBlock,
    /// Block offload for every component with blocks, leaf offload for one with leaves only, component offload
    /// otherwise.
    Block,
    /// Leaf offload for every group-offloadable component, component offload otherwise.
    Leaf,
    /// No routing.
    Off,
}

/// How much of a streamed component stays on the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ResidentPolicy {
    /// As much as fits beside the outside bytes, the streaming window and the activations
    /// ([`resident_budget`](crate::plan::budget::resident_budget)), for components called more than once per
    /// image.
    Fill,
    /// Nothing beyond the bytes outside the blocks.
    Zero,
}

/// Which host copies a preset pins.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PinPolicy {
    /// None.
    Never,
    /// A component's streamed bytes when they cross the link more than once per image and pinning shortens its
    /// predicted time per image by [`PIN_GAIN`](crate::plan::planner::PIN_GAIN) or more (the copies are not
    /// already hidden under compute).
    WhenItPays,
    /// The streamed bytes of components called more than once per image.
    Repeated,
    /// Every streamed component's host copy.
    All,
}

/// A preset's defaults: what applies to every setting nobody set.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PresetDefaults {
    /// How routes are chosen.
    pub routing: Routing,
    /// Whether every component stays resident when the whole pipeline fits.
    pub whole_pipeline_resident: bool,
    /// Whether streamed groups are prefetched on a worker thread.
    pub prefetch: bool,
    /// How many groups ahead are prefetched.
    pub prefetch_depth: usize,
    /// Blocks per group for block offload.
    pub blocks_per_group: usize,
    /// How the resident budget is set.
    pub resident: ResidentPolicy,
    /// What is pinned.
    pub pin: PinPolicy,
    /// Whether the full-pin rule ([`full_pin_zero_resident`](crate::plan::budget::full_pin_zero_resident))
    /// applies.
    pub full_pin_rule: bool,
    /// The `low_host_memory` default: whether every host copy that a checkpoint file or the disk store can serve
    /// leaves RAM, whether or not RAM would hold it.
    pub low_host_memory: bool,
}
