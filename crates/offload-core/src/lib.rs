//! Offload mechanism: memory accounting, the component model and `ComponentsManager`.
//!
//! This is the crate a model crate or an application depends on to make its models offloadable and run them
//! on a device with less memory than their weights:
//!
//! - [`size`] parses user sizes (`"3GB"`, `"13.5GiB"`) and formats them as the record prints them;
//! - [`DeviceMemory`] is the reading every decision is made from (a simulated card, a burn device, a fake);
//! - [`Offloadable`] is what a component implements to be moved between the host and a device;
//! - [`ComponentsManager`] registers components, enables auto offload, asks an
//!   [`OffloadStrategy`](offload_strategy::OffloadStrategy) what to evict, retries after out-of-memory errors,
//!   and keeps an [`OffloadRecord`] of every move;
//! - [`link::LinkMeter`] times each copy onto a device and gives the link's measured rates;
//! - [`Timeline`] records what happened when, on which thread (phases, moves, group uploads, device memory
//!   samples), and writes it as a Chrome trace-event file.
//!
//! It knows nothing about burn, CUDA or Z-Image: policy lives in `offload-strategy`, devices arrive through
//! [`DeviceMemory`] and [`Offloadable`] implementations.

#![forbid(unsafe_code)]

pub mod component;
pub mod device;
pub mod error;
pub mod link;
pub mod manager;
pub mod measured;
mod name;
pub mod plan;
pub mod record;
pub mod size;
pub mod timeline;

pub use component::{ComponentError, Offloadable};
pub use device::{DeviceLedger, DeviceMemory, DeviceName, DeviceNameError, Direction, NoLedger};
pub use error::{Error, Result};
pub use manager::{AutoOffloadSettings, ComponentInfo, ComponentsManager, Lookup};
pub use offload_strategy;
pub use plan::{
    ComponentPlan, ComponentSpec, HostMemory, Machine, Plan, PlanError, Preset, Route, Settings, enable_offload,
    plan_pipeline,
};
pub use record::{Action, DeviceRecords, FileRead, OffloadEvent, OffloadRecord, Reason, RecordRow, Refusals};
pub use size::{Size, SizeError, format_rate, format_size, parse_size};
pub use timeline::{Span, Timeline};
