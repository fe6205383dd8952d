//! Configuration of a group offloader: the device it uploads to (its one [`OffloadDevice`]), how far it prefetches,
//! what it keeps resident, and the record it reports to.
//!
//! This is the layer that validates user input ([`GroupOffloadConfig::validate`], called once by the engine's one
//! entrance, [`GroupOffload::new`](crate::parts::GroupOffload::new)); everything below trusts it: the engine sizes
//! its prefetch window by `prefetch_depth` unchecked. [`GroupOptions::validate`](crate::GroupOptions::validate)
//! applies the same prefetch rule (one function, `check_prefetch`) earlier, so a handle refuses bad options before it touches
//! the model; nothing between the two clamps or corrects a value.

use std::fmt;
use std::path::PathBuf;
use std::sync::Arc;

use offload_core::link::DiskMeter;
use offload_core::plan::MAX_PREFETCH_DEPTH;
use offload_core::{OffloadRecord, Timeline};

use crate::OffloadDevice;
use crate::error::{Error, Result};
use crate::weights::FileTable;

/// How a group offloader is set up. Build it with [`GroupOffloadConfig::new`] and the `with_*` methods.
#[derive(Clone)]
pub struct GroupOffloadConfig {
    /// The model's name, the first half of every record id (`"{model}/{group}"`).
    pub model: String,
    /// The device groups are uploaded to: the burn device, its name, its account (ledger and readings), its link's
    /// clock and its upload thread ([`OffloadDevice`]).
    pub device: OffloadDevice,
    /// Whether groups after the first forward are prefetched on the worker thread (`true` by default).
    pub prefetch: bool,
    /// How many groups ahead of the running one, in the captured order, are uploaded (1 by default).
    pub prefetch_depth: usize,
    /// Bytes of streamed groups that may stay on the device once released (0 by default): the first groups added
    /// (the order the model declares them in) that fit stay resident for good from their first release, like
    /// diffusers' requested `pin_groups`. They are chosen as the groups are added, so the pinned budget skips them
    /// whatever order the model calls its groups in.
    pub resident_budget: u64,
    /// Bytes of streamed groups' host copies to pin (0 by default): groups are pinned in registration order
    /// while they fit, through the device's staging (page-locked memory on CUDA, so uploads skip the driver's
    /// bounce buffer; a no-op on a CPU backend), and their uploads are charged as pinned copies
    /// ([`DeviceLedger::transfer_pinned`]). Host copies on disk are never pinned.
    pub pinned_budget: u64,
    /// Where to keep each group's host copy as a safetensors file instead of in host memory; `None` keeps it in
    /// memory.
    pub disk_dir: Option<PathBuf>,
    /// Bytes of streamed groups read from a file (their checkpoint file, or the disk store) whose read is kept in
    /// host memory, so later uploads copy it instead of reading the file again (0 by default): each group that
    /// reads a file keeps its read while the budget has room, in the order the groups are uploaded, and gives
    /// it back when it stays resident. The planner's split of the streamed groups over RAM and the file
    /// ([`ComponentPlan::ram_streamed_bytes`](offload_core::plan::ComponentPlan::ram_streamed_bytes)).
    pub ram_budget: u64,
    /// The sizes of the groups the pinned budget pins, one each, where a plan gave them
    /// ([`with_placed_sizes`](Self::with_placed_sizes)); `None`: the first streamed groups that fit the budget.
    pub pinned_groups: Option<Vec<u64>>,
    /// The sizes of the groups whose reads the RAM budget keeps, one each, where a plan gave them; `None`: the
    /// groups that fit the budget, in upload order.
    pub ram_groups: Option<Vec<u64>>,
    /// Further devices whose memory holds streamed groups between their uploads (donors), in the order a group
    /// tries them: see [`PeerDonor`]. Empty by default.
    pub donors: Vec<PeerDonor>,
    /// The record every move is added to, if any: the device manager's unless set.
    pub record: Option<OffloadRecord>,
    /// The timeline each group's upload, compute and release is recorded in, each on the thread it happens on
    /// (a prefetch on the worker's), with a device memory sample (from the device's readings) after every move: the
    /// device manager's unless set (disabled unless that one is enabled).
    pub timeline: Timeline,
    /// Whether each upload is synced and read back before its group is published (`true` by default); see
    /// [`GroupOptions::check_uploads`](crate::GroupOptions::check_uploads).
    pub check_uploads: bool,
    /// The table of a model bound to its checkpoint files ([`crate::weights`]): a parameter it holds that nothing
    /// read yet keeps its file tensor as its host copy, read at each upload (the file tier). `None`: every host
    /// copy is taken from the model's tensors.
    pub files: Option<FileTable>,
    /// The clock every read of a host copy from a file is timed on (a group's checkpoint file, or its disk-store
    /// file): the file table's meter for a model registered from its files, its own otherwise.
    pub disk: Arc<DiskMeter>,
}

impl fmt::Debug for GroupOffloadConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GroupOffloadConfig")
            .field("model", &self.model)
            .field("device", &self.device.name().as_str())
            .field("prefetch", &self.prefetch)
            .field("prefetch_depth", &self.prefetch_depth)
            .field("resident_budget", &self.resident_budget)
            .field("pinned_budget", &self.pinned_budget)
            .field("disk_dir", &self.disk_dir)
            .field("ram_budget", &self.ram_budget)
            .field("pinned_groups", &self.pinned_groups)
            .field("ram_groups", &self.ram_groups)
            .field("donors", &self.donors)
            .field("record", &self.record.is_some())
            .field("timeline", &self.timeline.is_enabled())
            .field("files", &self.files)
            .finish()
    }
}

impl GroupOffloadConfig {
    /// A configuration for `model` on `device`: prefetch on with depth 1, no resident budget, host memory store,
    /// recorded in the device manager's record and timeline. A burn `Device` converts to a device with nothing accounted ([`OffloadDevice`]'s `From`); give an
    /// [`OffloadDevice`] for a device with an account (`OffloadDevice::simulated(card)`).
    pub fn new(model: impl Into<String>, device: impl Into<OffloadDevice>) -> Self {
        let device = device.into();
        Self {
            model: model.into(),
            record: Some(device.manager().offload_record()),
            timeline: device.manager().timeline(),
            device,
            prefetch: true,
            prefetch_depth: 1,
            resident_budget: 0,
            pinned_budget: 0,
            disk_dir: None,
            ram_budget: 0,
            pinned_groups: None,
            ram_groups: None,
            donors: Vec::new(),
            check_uploads: true,
            files: None,
            disk: Arc::default(),
        }
    }

    /// Takes the host copies of the parameters `files` binds from their checkpoint files (the file tier), and
    /// times every file read on its meter.
    pub fn with_files(mut self, files: FileTable) -> Self {
        self.disk = files.meter().clone();
        self.files = Some(files);
        self
    }

    /// Times every read of a host copy from a file on `disk`.
    pub fn with_disk_meter(mut self, disk: Arc<DiskMeter>) -> Self {
        self.disk = disk;
        self
    }

    /// Syncs and reads back each upload before its group is published (`true`), or publishes it once its copies
    /// are queued (`false`).
    pub fn with_upload_checks(mut self, check: bool) -> Self {
        self.check_uploads = check;
        self
    }

    /// Turns prefetching on or off.
    pub fn with_prefetch(mut self, prefetch: bool) -> Self {
        self.prefetch = prefetch;
        self
    }

    /// Sets how many groups ahead are prefetched (1 to [`MAX_PREFETCH_DEPTH`] with prefetch on).
    pub fn with_prefetch_depth(mut self, depth: usize) -> Self {
        self.prefetch_depth = depth;
        self
    }

    /// Sets the bytes of released groups that may stay resident.
    pub fn with_resident_budget(mut self, bytes: u64) -> Self {
        self.resident_budget = bytes;
        self
    }

    /// Pins up to `bytes` of the streamed groups' host copies.
    pub fn with_pinned_budget(mut self, bytes: u64) -> Self {
        self.pinned_budget = bytes;
        self
    }

    /// Keeps host copies as safetensors files under `dir`.
    pub fn with_disk_store(mut self, dir: impl Into<PathBuf>) -> Self {
        self.disk_dir = Some(dir.into());
        self
    }

    /// Keeps the reads of up to `bytes` of streamed groups from their files in host memory (see
    /// [`ram_budget`](Self::ram_budget)).
    pub fn with_ram_budget(mut self, bytes: u64) -> Self {
        self.ram_budget = bytes;
        self
    }

    /// Adds a donor: up to its budget of streamed groups are held in its device's memory between their uploads
    /// (see [`PeerDonor`]). A group tries the donors in the order they were added, and goes to the first with
    /// room.
    pub fn with_donor(mut self, donor: PeerDonor) -> Self {
        self.donors.push(donor);
        self
    }

    /// Caps each donor's budget at its entry in `budgets` (by the donor device's name; 0 where it has none), the
    /// bytes a plan placed on it ([`GroupOptions::donor_budgets`](crate::GroupOptions::donor_budgets)), and orders
    /// the donors as `budgets` lists them: the plan's peers' order, in which its model of the run fills them.
    /// Empty `budgets`, or no donor, leave the configuration as it is. Call it after the donors are added
    /// ([`with_donor`](Self::with_donor)).
    pub fn with_donor_budgets(mut self, budgets: &[(String, u64)]) -> Self {
        if budgets.is_empty() {
            return self;
        }
        let position = |donor: &PeerDonor| budgets.iter().position(|(name, _)| name == donor.device.name().as_str());
        for donor in &mut self.donors {
            let planned = position(donor).map_or(0, |at| budgets[at].1);
            donor.budget = donor.budget.min(planned);
        }
        // A stable sort: the donors the plan did not name (budget 0) keep their order, after the named ones.
        self.donors.sort_by_key(|donor| position(donor).unwrap_or(usize::MAX));
        self
    }

    /// Where a plan knows each streamed group's size, the sizes it placed on pinned memory, in RAM and on each
    /// donor (by the donor device's name): each of those places then takes only groups of its sizes, one each, within
    /// its budget, so a run keeps the placement the plan's search chose even where groups differ in size (groups
    /// of one size cost the same anywhere, so which of them goes where does not matter). An empty list leaves its
    /// place taking whatever fits its budget. Call it after the donors are added.
    pub fn with_placed_sizes(mut self, pinned: &[u64], ram: &[u64], donors: &[(String, Vec<u64>)]) -> Self {
        if !pinned.is_empty() {
            self.pinned_groups = Some(pinned.to_vec());
        }
        if !ram.is_empty() {
            self.ram_groups = Some(ram.to_vec());
        }
        if !donors.is_empty() {
            for donor in &mut self.donors {
                // A donor the plan placed nothing on takes no size, as its budget there is 0.
                let sizes = donors.iter().find(|(name, _)| name == donor.device.name().as_str());
                donor.groups = Some(sizes.map_or_else(Vec::new, |(_, sizes)| sizes.clone()));
            }
        }
        self
    }

    /// Adds every move to `record`.
    pub fn with_record(mut self, record: OffloadRecord) -> Self {
        self.record = Some(record);
        self
    }

    /// Records every group's upload, compute and release in `timeline`.
    pub fn with_timeline(mut self, timeline: Timeline) -> Self {
        self.timeline = timeline;
        self
    }

    /// Checks the values a user can get wrong; called once by [`GroupOffload::new`](crate::parts::GroupOffload::new),
    /// before its engine starts: the model's name, and the prefetch depth (1 to [`MAX_PREFETCH_DEPTH`] with prefetch
    /// on; with it off, 0 too, but never past the bound). Each refusal is [`Error::InvalidConfig`] naming the
    /// value, the bound and the fix.
    pub fn validate(&self) -> Result<()> {
        if self.model.is_empty() || self.model.contains('/') {
            let problem = format!("the model name {:?} must be non-empty and contain no '/'", self.model);
            return Err(Error::InvalidConfig { model: self.model.clone(), problem });
        }
        for (index, donor) in self.donors.iter().enumerate() {
            self.check_donor(donor, &self.donors[..index])?;
        }
        check_prefetch(&self.model, self.prefetch, self.prefetch_depth)
    }

    /// Refuses a donor whose link has no finite positive rate, one that is the execution device, and one on a device
    /// an `earlier` donor is already on.
    fn check_donor(&self, donor: &PeerDonor, earlier: &[PeerDonor]) -> Result<()> {
        let problem = if !(donor.bytes_per_second.is_finite()
            && donor.bytes_per_second > 0.0
            && donor.latency_seconds.is_finite()
            && donor.latency_seconds >= 0.0)
        {
            format!(
                "the donor {}'s link is {} bytes/s with {} s of latency; give a finite positive rate (measured, or \
                 a datasheet's) and a finite, non-negative latency",
                donor.device.name(),
                donor.bytes_per_second,
                donor.latency_seconds
            )
        } else if donor.device.is(&self.device) {
            format!(
                "the donor is the execution device {} itself; give a second device (a streamed group is already \
                 on the execution device while it runs)",
                self.device.name()
            )
        } else if earlier.iter().any(|other| other.device.is(&donor.device)) {
            format!(
                "{} is given as a donor twice; add each device once, with the whole budget it can give",
                donor.device.name()
            )
        } else {
            return Ok(());
        };
        Err(Error::InvalidConfig { model: self.model.clone(), problem })
    }
}

/// A second device that holds streamed groups between their uploads (ComfyUI-MultiGPU's "donor"): a group that
/// streams keeps a copy in the donor's memory once it has been uploaded, while the donor's budget has room, in the
/// order the groups are uploaded, and later uploads copy it from the donor over the link between the cards instead
/// of from the host. Every byte it holds is charged to the donor's own ledger (its account, so a donor card that
/// runs out refuses it and the group keeps streaming from the host), and every copy from it to the execution
/// device's ledger as a copy from a peer ([`DeviceLedger::transfer_from_peer`](offload_core::DeviceLedger::transfer_from_peer)),
/// priced at this link. A group that stays resident gives its copy back. Float groups only: a quantized group
/// streams from the host. The planner's donor search ([`DonorProblem`](offload_core::plan::DonorProblem)) says which
/// budget pays: `cargo xtask plan --donor`.
#[derive(Clone)]
pub struct PeerDonor {
    /// The donor device: its burn device holds the copies, its ledger is charged for them.
    pub device: OffloadDevice,
    /// The most bytes of groups it holds.
    pub budget: u64,
    /// The rate of a copy from it to the execution device, bytes per second (NVLink, PCIe between the cards).
    pub bytes_per_second: f64,
    /// The fixed cost of one such copy, seconds.
    pub latency_seconds: f64,
    /// The sizes of the groups it takes, one each, where a plan gave them
    /// ([`GroupOffloadConfig::with_placed_sizes`]); `None`: the groups that fit its budget, in upload order.
    pub groups: Option<Vec<u64>>,
}

impl PeerDonor {
    /// A donor of `budget` bytes on `device`, reached at `bytes_per_second` with no latency.
    pub fn new(device: OffloadDevice, budget: u64, bytes_per_second: f64) -> Self {
        Self { device, budget, bytes_per_second, latency_seconds: 0.0, groups: None }
    }

    /// The donor as a peer of a plan's machine (`DeviceFacts::with_peer`): its device's name, its budget as the
    /// bytes it can give, its link's rate and latency (given). The planner then places the model's groups over it,
    /// and `apply_plan` caps it at the plan's share.
    ///
    /// ```
    /// use group_offload::config::PeerDonor;
    /// use group_offload::OffloadDevice;
    /// use memory_sim::{CardSpec, SimCard};
    /// let spec = CardSpec::parse("4GB")?.with_device(offload_core::DeviceName::parse("cuda:1")?);
    /// let card = OffloadDevice::simulated(SimCard::new(spec));
    /// let peer = PeerDonor::new(card, 3_000_000_000, 50e9).peer_device();
    /// assert_eq!((peer.name.as_str(), peer.bytes, peer.bytes_per_second), ("cuda:1", 3_000_000_000, 50e9));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn peer_device(&self) -> offload_core::plan::PeerDevice {
        offload_core::plan::PeerDevice::new(
            self.device.name().as_str(),
            self.budget,
            self.bytes_per_second,
            self.latency_seconds,
        )
    }

    /// A real device as `exec`'s donor, its budget what its readings give as available now, and its copies
    /// priced by measurement: at `measured` where earlier runs measured the pair
    /// (`ProfileStore::measured_peer(exec, device)`, feature `io`), else by [`PeerDonor::PROBE_COPIES`] copies of
    /// `probe_bytes` timed now ([`OffloadDevice::time_copies_from`]). Returns the donor and the same donor as a
    /// plan's peer, its rate's source with it (measured by earlier runs, or by the probe: one run of its copies).
    /// The run's own copies are then timed on `exec`'s meter for the peer ([`OffloadDevice::peer_rates`]), for the
    /// next run's `measured`.
    pub fn timed(
        exec: &OffloadDevice,
        device: OffloadDevice,
        measured: Option<offload_core::plan::MeasuredPeer>,
        probe_bytes: u64,
    ) -> Result<(Self, offload_core::plan::PeerDevice)> {
        use offload_core::plan::{LinkSource, PeerDevice};
        let budget = device.readings().available();
        let name = device.name().as_str().to_string();
        let peer = match measured.filter(|m| m.median.is_finite() && m.median > 0.0) {
            Some(measured) => PeerDevice::new(&name, budget, measured.median, 0.0).with_measured(Some(measured)),
            None => {
                let probe = exec.time_copies_from(&device, probe_bytes, Self::PROBE_COPIES)?;
                let source = LinkSource::Measured { runs: 1, uploads: probe.uploads as u64 };
                PeerDevice::new(&name, budget, probe.median, 0.0).with_source(source)
            }
        };
        let donor = Self::new(device, budget, peer.bytes_per_second);
        Ok((donor, peer))
    }

    /// The copies [`PeerDonor::timed`] times when nothing measured the pair before: the rate is their median.
    pub const PROBE_COPIES: usize = 5;

    /// Seconds one copy of `bytes` from the donor takes.
    pub fn seconds(&self, bytes: u64) -> f64 {
        bytes as f64 / self.bytes_per_second + self.latency_seconds
    }
}

impl fmt::Debug for PeerDonor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PeerDonor")
            .field("device", &self.device.name().as_str())
            .field("budget", &self.budget)
            .field("bytes_per_second", &self.bytes_per_second)
            .field("latency_seconds", &self.latency_seconds)
            .field("groups", &self.groups)
            .finish()
    }
}

/// The prefetch rule, the one every layer of this crate that takes a depth applies: a depth of 1 to
/// [`MAX_PREFETCH_DEPTH`] with prefetch on; with prefetch off the depth is unused and may be 0, but never past the
/// bound (a value past it is a mistake, not a plan). offload-core's settings refuse past the same bound.
pub(crate) fn check_prefetch(model: &str, prefetch: bool, depth: usize) -> Result<()> {
    let problem = if depth > MAX_PREFETCH_DEPTH {
        format!(
            "prefetch_depth is {depth}, past the bound of {MAX_PREFETCH_DEPTH} (offload_core::plan::MAX_PREFETCH_DEPTH): \
             each group ahead is held on the device, and depth 1 already overlaps each upload with a group's \
             compute; use 1 to {MAX_PREFETCH_DEPTH}"
        )
    } else if prefetch && depth == 0 {
        format!(
            "prefetch_depth is 0 with prefetch on; use 1 or more (at most {MAX_PREFETCH_DEPTH}), or turn prefetch off"
        )
    } else {
        return Ok(());
    };
    Err(Error::InvalidConfig { model: model.to_string(), problem })
}

/// Decides which modules are leaves at leaf level, from the container type burn reports for them
/// (`"Struct:Linear"`, `"Struct:Conv2d"`, `"Struct:PtLinear"`).
///
/// ```
/// use group_offload::LeafPredicate;
/// let leaves = LeafPredicate::default_layers().or_types(&["PtLinear"]);
/// assert!(leaves.is_leaf("Struct:PtLinear"));
/// assert!(leaves.is_leaf("Struct:Linear"));
/// assert!(!leaves.is_leaf("Struct:LayerNorm"));
/// ```
#[derive(Clone)]
pub struct LeafPredicate(Arc<dyn Fn(&str) -> bool + Send + Sync>);

impl fmt::Debug for LeafPredicate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("LeafPredicate(..)")
    }
}

/// The layer types diffusers groups at leaf level, by burn's struct names. Norms are left out on purpose: their
/// weights travel with the group of the module that holds them.
pub const DEFAULT_LEAF_TYPES: &[&str] =
    &["Linear", "Conv1d", "Conv2d", "Conv3d", "ConvTranspose1d", "ConvTranspose2d", "ConvTranspose3d", "Embedding"];

impl LeafPredicate {
    /// A predicate from any function of the container type.
    pub fn new(f: impl Fn(&str) -> bool + Send + Sync + 'static) -> Self {
        Self(Arc::new(f))
    }

    /// burn's Linear, Conv and Embedding layers ([`DEFAULT_LEAF_TYPES`]).
    pub fn default_layers() -> Self {
        Self::types(DEFAULT_LEAF_TYPES)
    }

    /// Exactly the structs named in `names` (without the `Struct:` prefix).
    pub fn types(names: &[&str]) -> Self {
        let names: Vec<String> = names.iter().map(|n| format!("Struct:{n}")).collect();
        Self::new(move |container| names.iter().any(|n| n == container))
    }

    /// This predicate, or the structs named in `names`.
    pub fn or_types(self, names: &[&str]) -> Self {
        let other = Self::types(names);
        Self::new(move |container| (self.0)(container) || (other.0)(container))
    }

    /// Whether a module of this container type is a leaf.
    pub fn is_leaf(&self, container_type: &str) -> bool {
        (self.0)(container_type)
    }
}

impl Default for LeafPredicate {
    fn default() -> Self {
        Self::default_layers()
    }
}
