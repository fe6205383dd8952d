//! What a model crate imports: `use group_offload::prelude::*;`. The concepts behind each name are in
//! `docs/model-guide.md`.
//!
//! - declaring a model: [`OffloadModel`] (the trait and its derive);
//! - writing its forward: [`Blocks`], [`Single`], [`Nested`], [`Shell`], [`Layer`], [`leaf!`], [`narrow!`],
//!   [`Result`], and [`whole`] for the resident forward;
//! - running it: [`ModelHandle`], [`OffloadDevice`], [`GroupOptions`], [`GroupLevel`], and [`module_bytes`] to size a
//!   card by the model;
//! - testing it: [`check_streaming`].

pub use crate::error::{Error, Result};
pub use crate::handle::ModelHandle;
pub use crate::model::{GroupLevel, GroupOptions, check_streaming, whole};
pub use crate::offload_device::OffloadDevice;
pub use crate::view::{Blocks, Layer, Nested, Shell, Single};
pub use crate::whole::module_bytes;
pub use crate::{OffloadModel, leaf, narrow};
