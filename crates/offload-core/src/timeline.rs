//! The timeline of a run: spans (phases, onloads, offloads, group uploads, computes and releases), instants and
//! device memory samples, each on the thread that made it, written as a Chrome trace-event file.
//!
//! One [`Timeline`] is shared by everything that moves or computes in a run, the way one
//! [`OffloadRecord`](crate::OffloadRecord) is: the [`ComponentsManager`](crate::ComponentsManager) holds it
//! ([`set_timeline`](crate::ComponentsManager::set_timeline)) and records each onload and offload, a group
//! offloader records each group's upload (on the prefetch worker's thread when it is a prefetch), compute and
//! release, and a pipeline records its phases. A disabled timeline (the default) holds nothing: every call on it
//! returns at once, without reading a clock or allocating.
//!
//! Timestamps are nanoseconds since one origin (the [`Timeline::enabled`] call), so events from every thread
//! line up. Threads are numbered in the order they first record (1, 2, ...) and named from
//! [`std::thread::current`]. `Timeline::write_chrome_trace` (feature `io`) writes the
//! [Chrome trace-event format](https://docs.google.com/document/d/1CvAClvFfyA5R-PhYUmn5OOQtYMH4h6I0nSsKchNAySU):
//! complete (`"X"`) events with `ts` and `dur` in microseconds, instant (`"i"`) events, counter (`"C"`) events of
//! device memory and `thread_name` metadata (`"M"`), which Perfetto (<https://ui.perfetto.dev>) and
//! `chrome://tracing` open.
//!
//! Writing the file needs the crate's `io` feature (JSON through serde_json); recording does not.
//!
//! Recording a span allocates nothing per call: a category the workspace records under ([`category`]) is kept
//! as a reference to its constant, a name or an arg's key of up to [`INLINE_LABEL`] bytes (every component id
//! and group id of the workspace) is copied inline, and the event is appended to a list that grows by doubling.
//! Only a longer name, an arg's text and the list's growth reach the allocator. [`Timeline::events`] copies the
//! events out as plain [`TimelineEvent`]s.

use std::fmt;
#[cfg(feature = "io")]
use std::io::{self, Write};
use std::sync::Arc;
use std::sync::mpsc;
use std::thread::{JoinHandle, Thread, ThreadId};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
#[cfg(feature = "io")]
use serde_json::{Map, Value, json};

use crate::device::DeviceMemory;

/// The most events a timeline keeps; later ones are counted and dropped (the file says how many).
pub const MAX_TIMELINE_EVENTS: usize = 1_000_000;

/// The name of the counter track of device memory samples (of the first device sampled; every other device has a
/// track of its own, [`memory_track`]).
pub const MEMORY_COUNTER: &str = "device memory";

/// The counter track of a device other than the first one sampled: `device memory cuda:1`.
pub fn memory_track(device: &crate::DeviceName) -> String {
    format!("{MEMORY_COUNTER} {device}")
}

/// The name of the counter track of the link rate the trace file derives from its group uploads: one sample at
/// the end of each upload span that carries its `bytes`, with `GB/s` = those bytes ÷ the span's duration (the
/// upload as the clock saw it: the charge, the copy, the sync and the read-back).
pub const LINK_COUNTER: &str = "link rate";

/// The longest name (or arg's key) a timeline keeps without a heap allocation, in bytes.
pub const INLINE_LABEL: usize = 30;

/// The categories the workspace records under, one per kind of span; the trace viewer filters by them.
pub mod category {
    /// A phase of a pipeline (`encode`, `denoise`, `decode`).
    pub const PHASE: &str = "phase";
    /// One step inside a phase (a denoising step).
    pub const STEP: &str = "step";
    /// A component's run through the manager (its onload, if any, and its call).
    pub const RUN: &str = "run";
    /// A whole component moved onto the execution device by the manager.
    pub const ONLOAD: &str = "onload";
    /// A whole component moved off the execution device by the manager.
    pub const OFFLOAD: &str = "offload";
    /// A group uploaded by a group offloader (on the caller's thread, or the prefetch worker's).
    pub const UPLOAD: &str = "upload";
    /// A group borrowed on the device while its layers compute.
    pub const COMPUTE: &str = "compute";
    /// A group dropped from the device after its compute.
    pub const RELEASE: &str = "release";
    /// A group's host copy read from a file (its checkpoint file, the file tier, or the disk store).
    pub const FILE_READ: &str = "file_read";
    /// Device memory samples (the counter track).
    pub const MEMORY: &str = "memory";

    /// Every category above: a span of one of them keeps a reference to the constant, not a copy.
    pub(crate) const ALL: [&str; 10] = [PHASE, STEP, RUN, ONLOAD, OFFLOAD, UPLOAD, COMPUTE, RELEASE, FILE_READ, MEMORY];
}

/// A category, a name or an arg's key as a timeline keeps it: without a heap allocation unless it is a name
/// longer than [`INLINE_LABEL`] bytes.
#[derive(Clone)]
enum Label {
    /// One of the [`category`] constants (or another `'static` text).
    Static(&'static str),
    /// A copy of a short text: its first `len` bytes, copied whole from a `str`.
    Inline { len: u8, bytes: [u8; INLINE_LABEL] },
    /// A longer text.
    Heap(Box<str>),
}

impl Label {
    /// A category: a reference to the constant when it is one of [`category::ALL`].
    fn category(text: &str) -> Self {
        match category::ALL.iter().find(|known| **known == text) {
            Some(known) => Label::Static(known),
            None => Label::text(text),
        }
    }

    /// Any text: inline when it fits.
    fn text(text: &str) -> Self {
        match u8::try_from(text.len()) {
            Ok(len) if text.len() <= INLINE_LABEL => {
                let mut bytes = [0; INLINE_LABEL];
                bytes[..text.len()].copy_from_slice(text.as_bytes());
                Label::Inline { len, bytes }
            }
            _ => Label::Heap(text.into()),
        }
    }

    fn as_str(&self) -> &str {
        match self {
            Label::Static(text) => text,
            // The bytes are a whole `str`, copied in `text`, so they are UTF-8.
            Label::Inline { len, bytes } => {
                std::str::from_utf8(&bytes[..usize::from(*len)]).unwrap_or_else(|_| unreachable!("copied from a str"))
            }
            Label::Heap(text) => text,
        }
    }
}

impl fmt::Debug for Label {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self.as_str(), f)
    }
}

/// A value attached to an event (`args` in the trace file).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ArgValue {
    /// A count or a number of bytes.
    Number(u64),
    /// Any text: a reason, a device, an error.
    Text(String),
}

impl From<u64> for ArgValue {
    fn from(value: u64) -> Self {
        ArgValue::Number(value)
    }
}

impl From<usize> for ArgValue {
    fn from(value: usize) -> Self {
        ArgValue::Number(value as u64)
    }
}

impl From<&str> for ArgValue {
    fn from(value: &str) -> Self {
        ArgValue::Text(value.to_string())
    }
}

impl From<String> for ArgValue {
    fn from(value: String) -> Self {
        ArgValue::Text(value)
    }
}

#[cfg(feature = "io")]
impl ArgValue {
    fn to_json(&self) -> Value {
        match self {
            ArgValue::Number(n) => json!(n),
            ArgValue::Text(t) => json!(t),
        }
    }
}

/// What kind of event a [`TimelineEvent`] is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventKind {
    /// Something that took time: it started at the event's start and lasted `duration_ns`.
    Span {
        /// How long it lasted, in nanoseconds.
        duration_ns: u64,
    },
    /// Something that happened at one moment.
    Instant,
    /// A sample of a counter track: the event's args are the counter's values at its start.
    Counter,
}

/// One event of a timeline, as plain data.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TimelineEvent {
    /// Span, instant or counter sample.
    pub kind: EventKind,
    /// Its category ([`category`]).
    pub category: String,
    /// What it is about: a phase, a component id, a group id, a counter's name.
    pub name: String,
    /// When it started (or happened), in nanoseconds since the timeline's origin.
    pub start_ns: u64,
    /// The thread it was recorded on, as numbered by the timeline ([`Timeline::threads`]).
    pub thread: u64,
    /// Its values: bytes, a reason, a device; a counter's samples.
    pub args: Vec<(String, ArgValue)>,
}

impl TimelineEvent {
    /// The value of the arg `key`, if the event has it.
    pub fn arg(&self, key: &str) -> Option<&ArgValue> {
        self.args.iter().find(|(k, _)| k == key).map(|(_, v)| v)
    }

    /// The event as one Chrome trace event.
    #[cfg(feature = "io")]
    fn to_chrome(&self, pid: u64) -> Value {
        let mut event = Map::new();
        event.insert("name".into(), json!(self.name));
        event.insert("cat".into(), json!(self.category));
        let ph = match self.kind {
            EventKind::Span { duration_ns } => {
                event.insert("dur".into(), json!(micros(duration_ns)));
                "X"
            }
            EventKind::Instant => {
                // Scoped to its thread, so it is drawn on the thread's track.
                event.insert("s".into(), json!("t"));
                "i"
            }
            EventKind::Counter => "C",
        };
        event.insert("ph".into(), json!(ph));
        event.insert("ts".into(), json!(micros(self.start_ns)));
        event.insert("pid".into(), json!(pid));
        event.insert("tid".into(), json!(self.thread));
        if !self.args.is_empty() {
            let args: Map<String, Value> = self.args.iter().map(|(k, v)| (k.clone(), v.to_json())).collect();
            event.insert("args".into(), Value::Object(args));
        }
        Value::Object(event)
    }
}

/// An event as a timeline keeps it: a [`TimelineEvent`] whose texts are [`Label`]s.
struct Recorded {
    kind: EventKind,
    category: Label,
    name: Label,
    start_ns: u64,
    thread: u64,
    args: Vec<(Label, ArgValue)>,
}

impl Recorded {
    fn from_event(event: TimelineEvent) -> Self {
        Self {
            kind: event.kind,
            category: Label::category(&event.category),
            name: Label::text(&event.name),
            start_ns: event.start_ns,
            thread: event.thread,
            args: event.args.into_iter().map(|(key, value)| (Label::text(&key), value)).collect(),
        }
    }

    fn to_event(&self) -> TimelineEvent {
        TimelineEvent {
            kind: self.kind,
            category: self.category.as_str().to_string(),
            name: self.name.as_str().to_string(),
            start_ns: self.start_ns,
            thread: self.thread,
            args: self.args.iter().map(|(key, value)| (key.as_str().to_string(), value.clone())).collect(),
        }
    }
}

/// Nanoseconds as the trace's microseconds, keeping the sub-microsecond part.
#[cfg(feature = "io")]
fn micros(ns: u64) -> f64 {
    ns as f64 / 1000.0
}

/// One device memory sample, read back from a timeline's counter track ([`Timeline::memory_samples`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemorySample {
    /// When it was taken, in nanoseconds since the timeline's origin.
    pub at_ns: u64,
    /// Bytes allocated on the device ([`DeviceMemory::allocated`]).
    pub allocated: u64,
    /// Bytes a new allocation could still get ([`DeviceMemory::available`]).
    pub available: u64,
}

/// A thread that recorded on a timeline: its number in the trace and its name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ThreadInfo {
    /// The `tid` of its events.
    pub tid: u64,
    /// Its name ([`std::thread::Thread::name`]), or `thread <tid>` for an unnamed thread.
    pub name: String,
}

struct Inner {
    origin: Instant,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    events: Vec<Recorded>,
    dropped: u64,
    threads: Vec<ThreadInfo>,
    /// The number of each thread that recorded itself. A run records from a few threads (the caller's, the
    /// prefetch workers', the sampler's), so a scan is quicker than hashing.
    by_id: Vec<(ThreadId, u64)>,
    /// The device of the first memory sample: its samples are the [`MEMORY_COUNTER`] track, every other device's a
    /// track of its own ([`memory_track`]).
    first_device: Option<crate::DeviceName>,
}

impl State {
    /// The number of `thread`, numbering and naming it on its first event.
    fn tid(&mut self, thread: &Thread) -> u64 {
        let id = thread.id();
        if let Some((_, tid)) = self.by_id.iter().find(|(known, _)| *known == id) {
            return *tid;
        }
        let tid = self.threads.len() as u64 + 1;
        let name = thread.name().map_or_else(|| format!("thread {tid}"), str::to_string);
        self.by_id.push((id, tid));
        self.threads.push(ThreadInfo { tid, name });
        tid
    }

    fn push(&mut self, event: Recorded) {
        if self.events.len() >= MAX_TIMELINE_EVENTS {
            self.dropped += 1;
        } else {
            self.events.push(event);
        }
    }
}

/// The shared recorder of a run's timeline; cloning shares it. See the [module documentation](self).
///
/// It is `Send + Sync`: spans are recorded from the caller's threads and the prefetch workers at once. Its one
/// lock is taken only to push an event or copy them out, never while anything runs.
#[derive(Clone, Default)]
pub struct Timeline {
    inner: Option<Arc<Inner>>,
}

impl fmt::Debug for Timeline {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.inner {
            None => f.write_str("Timeline(disabled)"),
            Some(inner) => f.debug_struct("Timeline").field("events", &inner.state.lock().events.len()).finish(),
        }
    }
}

impl Timeline {
    /// A timeline that records nothing: what everything holds when no trace was asked for.
    pub fn disabled() -> Self {
        Self { inner: None }
    }

    /// A recording timeline whose origin is now.
    pub fn enabled() -> Self {
        Self { inner: Some(Arc::new(Inner { origin: Instant::now(), state: Mutex::new(State::default()) })) }
    }

    /// Whether it records.
    pub fn is_enabled(&self) -> bool {
        self.inner.is_some()
    }

    /// Nanoseconds since the origin, or `None` when disabled.
    pub fn now_ns(&self) -> Option<u64> {
        self.inner.as_ref().map(|inner| elapsed_ns(inner.origin))
    }

    /// Starts a span of `category` named `name` on this thread; it ends (and is recorded) when the returned
    /// [`Span`] is dropped or [`end`](Span::end)ed. On a disabled timeline nothing is allocated.
    pub fn span(&self, category: &str, name: &str) -> Span {
        self.clone().into_span(category, name)
    }

    /// [`span`](Self::span), keeping this handle in the span rather than another clone of it.
    pub(crate) fn into_span(self, category: &str, name: &str) -> Span {
        Span {
            open: self.inner.map(|inner| OpenSpan {
                start_ns: elapsed_ns(inner.origin),
                inner,
                category: Label::category(category),
                name: Label::text(name),
                thread: std::thread::current(),
                args: Vec::new(),
            }),
        }
    }

    /// Records a span that started at `start_ns` (from [`now_ns`](Self::now_ns)) and ends now, on this thread:
    /// for a span whose start and end are far apart in the code (a borrowed group's compute).
    pub fn span_since(&self, category: &str, name: &str, start_ns: u64, args: Vec<(String, ArgValue)>) {
        let Some(inner) = &self.inner else { return };
        let end = elapsed_ns(inner.origin);
        let thread = std::thread::current();
        let mut state = inner.state.lock();
        let tid = state.tid(&thread);
        state.push(Recorded {
            kind: EventKind::Span { duration_ns: end.saturating_sub(start_ns) },
            category: Label::category(category),
            name: Label::text(name),
            start_ns,
            thread: tid,
            args: args.into_iter().map(|(key, value)| (Label::text(&key), value)).collect(),
        });
    }

    /// Records that something happened now, on this thread.
    pub fn instant(&self, category: &str, name: &str, args: &[(&str, ArgValue)]) {
        let Some(inner) = &self.inner else { return };
        let start_ns = elapsed_ns(inner.origin);
        let thread = std::thread::current();
        let mut state = inner.state.lock();
        let tid = state.tid(&thread);
        state.push(Recorded {
            kind: EventKind::Instant,
            category: Label::category(category),
            name: Label::text(name),
            start_ns,
            thread: tid,
            args: args.iter().map(|(key, value)| (Label::text(key), value.clone())).collect(),
        });
    }

    /// Records a sample of the device memory counter track ([`MEMORY_COUNTER`]): `allocated` and `available`
    /// as `memory` reads them now. Reading is cheap by [`DeviceMemory`]'s contract; a disabled timeline does not
    /// read at all.
    pub fn sample_memory(&self, memory: &dyn DeviceMemory) {
        let Some(inner) = &self.inner else { return };
        let (allocated, available, device) = (memory.allocated(), memory.available(), memory.device());
        let start_ns = elapsed_ns(inner.origin);
        let thread = std::thread::current();
        let mut state = inner.state.lock();
        let tid = state.tid(&thread);
        let first = state.first_device.get_or_insert_with(|| device.clone());
        let name = if *first == device { Label::Static(MEMORY_COUNTER) } else { Label::text(&memory_track(&device)) };
        state.push(Recorded {
            kind: EventKind::Counter,
            category: Label::Static(category::MEMORY),
            name,
            start_ns,
            thread: tid,
            args: vec![(Label::Static("allocated"), allocated.into()), (Label::Static("available"), available.into())],
        });
    }

    /// Samples `memory` every `every` on a thread of its own (named `memory sampler`) until the returned
    /// [`MemorySampler`] is dropped: between the samples taken at each move, these show what a call holds while
    /// it runs (its activations). On a disabled timeline no thread starts.
    pub fn sample_every(&self, memory: Arc<dyn DeviceMemory>, every: Duration) -> MemorySampler {
        if !self.is_enabled() {
            return MemorySampler { stop: None, handle: None };
        }
        let (stop, stopped) = mpsc::channel::<()>();
        let timeline = self.clone();
        let spawned = std::thread::Builder::new().name("memory sampler".into()).spawn(move || {
            loop {
                timeline.sample_memory(memory.as_ref());
                match stopped.recv_timeout(every) {
                    Err(mpsc::RecvTimeoutError::Timeout) => continue,
                    // Stopped, or the sampler was dropped.
                    _ => break,
                }
            }
        });
        match spawned {
            Ok(handle) => MemorySampler { stop: Some(stop), handle: Some(handle) },
            Err(error) => {
                tracing::warn!("cannot start the memory sampler ({error}); memory is sampled at each move only");
                MemorySampler { stop: None, handle: None }
            }
        }
    }

    /// Adds an event as given, with its own timestamp and thread number: for timelines built by hand (tests,
    /// imports). Name its thread with [`name_thread`](Self::name_thread).
    pub fn push(&self, event: TimelineEvent) {
        if let Some(inner) = &self.inner {
            inner.state.lock().push(Recorded::from_event(event));
        }
    }

    /// Names thread `tid` for [`push`](Self::push)ed events (a thread that records itself is named on its own).
    pub fn name_thread(&self, tid: u64, name: &str) {
        let Some(inner) = &self.inner else { return };
        let mut state = inner.state.lock();
        match state.threads.iter_mut().find(|t| t.tid == tid) {
            Some(thread) => thread.name = name.to_string(),
            None => state.threads.push(ThreadInfo { tid, name: name.to_string() }),
        }
    }

    /// A copy of the events, in the order they were recorded (a span is recorded when it ends).
    pub fn events(&self) -> Vec<TimelineEvent> {
        self.inner
            .as_ref()
            .map(|inner| inner.state.lock().events.iter().map(Recorded::to_event).collect())
            .unwrap_or_default()
    }

    /// The threads that recorded, by number.
    pub fn threads(&self) -> Vec<ThreadInfo> {
        let mut threads = self.inner.as_ref().map(|inner| inner.state.lock().threads.clone()).unwrap_or_default();
        threads.sort_by_key(|t| t.tid);
        threads
    }

    /// Events dropped past [`MAX_TIMELINE_EVENTS`].
    pub fn dropped(&self) -> u64 {
        self.inner.as_ref().map_or(0, |inner| inner.state.lock().dropped)
    }

    /// The device memory samples of the first device sampled (a pipeline's execution device), oldest first.
    pub fn memory_samples(&self) -> Vec<MemorySample> {
        self.samples_of(MEMORY_COUNTER)
    }

    /// Every device's memory samples, one track each, oldest first: the first device sampled under
    /// [`MEMORY_COUNTER`], then each other device under its own track's name ([`memory_track`]), in the order
    /// they were first sampled. A run over several devices (a device map) shows each device apart.
    pub fn memory_tracks(&self) -> Vec<(String, Vec<MemorySample>)> {
        let mut names: Vec<String> = Vec::new();
        for event in self.events().iter().filter(|e| e.kind == EventKind::Counter && e.category == category::MEMORY) {
            if !names.contains(&event.name) {
                names.push(event.name.clone());
            }
        }
        names.sort_by_key(|name| name != MEMORY_COUNTER);
        names.into_iter().map(|name| (name.clone(), self.samples_of(&name))).collect()
    }

    /// The samples of the counter track `track`, oldest first.
    fn samples_of(&self, track: &str) -> Vec<MemorySample> {
        let number = |event: &TimelineEvent, key: &str| match event.arg(key) {
            Some(ArgValue::Number(n)) => *n,
            _ => 0,
        };
        let mut samples: Vec<MemorySample> = self
            .events()
            .iter()
            .filter(|e| e.kind == EventKind::Counter && e.name == track)
            .map(|e| MemorySample {
                at_ns: e.start_ns,
                allocated: number(e, "allocated"),
                available: number(e, "available"),
            })
            .collect();
        samples.sort_by_key(|s| s.at_ns);
        samples
    }

    /// Writes the timeline as a Chrome trace-event JSON object (`{"traceEvents": [...], "displayTimeUnit":
    /// "ms"}`): the process and thread names first, then the events sorted by start, one per line (feature
    /// `io`).
    ///
    /// ```
    /// use offload_core::timeline::{Timeline, category};
    ///
    /// let timeline = Timeline::enabled();
    /// {
    ///     let _phase = timeline.span(category::PHASE, "encode");
    ///     timeline.span(category::ONLOAD, "text_encoder_1").arg("bytes", 4096u64).end();
    /// }
    /// let mut json = Vec::new();
    /// timeline.write_chrome_trace(&mut json)?;
    /// let trace: serde_json::Value = serde_json::from_slice(&json).unwrap();
    /// assert_eq!(trace["traceEvents"].as_array().unwrap().len(), 4); // process and thread names, two spans
    /// assert!(Timeline::disabled().events().is_empty());
    /// # Ok::<(), std::io::Error>(())
    /// ```
    #[cfg(feature = "io")]
    pub fn write_chrome_trace(&self, out: &mut dyn Write) -> io::Result<()> {
        const PID: u64 = 1;
        let mut lines: Vec<Value> = vec![json!({
            "name": "process_name", "ph": "M", "pid": PID, "tid": 0, "args": { "name": "offload" }
        })];
        for thread in self.threads() {
            lines.push(json!({
                "name": "thread_name", "ph": "M", "pid": PID, "tid": thread.tid, "args": { "name": thread.name }
            }));
        }
        let mut events = self.events();
        events.extend(link_samples(&events));
        // Stable: events that start together keep the order they were recorded in.
        events.sort_by_key(|e| e.start_ns);
        lines.extend(events.iter().map(|e| e.to_chrome(PID)));
        out.write_all(b"{\"traceEvents\":[\n")?;
        for (i, line) in lines.iter().enumerate() {
            if i > 0 {
                out.write_all(b",\n")?;
            }
            serde_json::to_writer(&mut *out, line)?;
        }
        write!(out, "\n],\"displayTimeUnit\":\"ms\",\"otherData\":{{\"dropped_events\":{}}}}}\n", self.dropped())?;
        Ok(())
    }
}

/// The [`LINK_COUNTER`] samples of `events`' upload spans. Rates are in MB/s, a whole number, as counter args are
/// numbers of this timeline's kind; the arg's key says the unit.
#[cfg(feature = "io")]
fn link_samples(events: &[TimelineEvent]) -> Vec<TimelineEvent> {
    events
        .iter()
        .filter(|e| e.category == category::UPLOAD)
        .filter_map(|e| {
            let EventKind::Span { duration_ns } = e.kind else { return None };
            let Some(ArgValue::Number(bytes)) = e.arg("bytes") else { return None };
            (duration_ns > 0).then(|| TimelineEvent {
                kind: EventKind::Counter,
                category: category::UPLOAD.to_string(),
                name: LINK_COUNTER.to_string(),
                start_ns: e.start_ns + duration_ns,
                thread: e.thread,
                // bytes per nanosecond is GB/s; times 1000, MB/s.
                args: vec![("MB/s".to_string(), ArgValue::Number(bytes.saturating_mul(1000) / duration_ns))],
            })
        })
        .collect()
}

fn elapsed_ns(origin: Instant) -> u64 {
    u64::try_from(origin.elapsed().as_nanos()).unwrap_or(u64::MAX)
}

/// The periodic memory sampler of a timeline ([`Timeline::sample_every`]); dropping it stops the sampler
/// thread and waits for it.
#[derive(Debug)]
pub struct MemorySampler {
    stop: Option<mpsc::Sender<()>>,
    handle: Option<JoinHandle<()>>,
}

impl MemorySampler {
    /// Stops sampling now.
    pub fn stop(self) {}
}

impl Drop for MemorySampler {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(handle) = self.handle.take() {
            let _ = handle.join();
        }
    }
}

struct OpenSpan {
    inner: Arc<Inner>,
    category: Label,
    name: Label,
    start_ns: u64,
    thread: Thread,
    args: Vec<(Label, ArgValue)>,
}

/// A span being recorded ([`Timeline::span`]): recorded, on the thread that opened it, when dropped or
/// [`end`](Self::end)ed. On a disabled timeline it is empty and every method does nothing.
#[must_use = "a span is recorded when it is dropped; bind it to a variable that lives as long as the work"]
pub struct Span {
    open: Option<OpenSpan>,
}

impl fmt::Debug for Span {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.open {
            None => f.write_str("Span(disabled)"),
            Some(open) => f.debug_struct("Span").field("name", &open.name).field("category", &open.category).finish(),
        }
    }
}

impl Span {
    /// Adds an arg (bytes, a reason, a device).
    pub fn arg(mut self, key: &str, value: impl Into<ArgValue>) -> Self {
        self.set_arg(key, value);
        self
    }

    /// Adds an arg to a span already bound (an outcome known only at its end).
    pub fn set_arg(&mut self, key: &str, value: impl Into<ArgValue>) {
        if let Some(open) = &mut self.open {
            open.args.push((Label::text(key), value.into()));
        }
    }

    /// Ends the span now.
    pub fn end(self) {}
}

impl Drop for Span {
    fn drop(&mut self) {
        let Some(open) = self.open.take() else { return };
        let end = elapsed_ns(open.inner.origin);
        let mut state = open.inner.state.lock();
        let tid = state.tid(&open.thread);
        state.push(Recorded {
            kind: EventKind::Span { duration_ns: end.saturating_sub(open.start_ns) },
            category: open.category,
            name: open.name,
            start_ns: open.start_ns,
            thread: tid,
            args: open.args,
        });
    }
}

#[cfg(test)]
mod tests {
    #[cfg(feature = "io")]
    use expect_test::expect;

    use super::*;

    #[cfg(feature = "io")]
    fn event(kind: EventKind, category: &str, name: &str, start_ns: u64, thread: u64) -> TimelineEvent {
        TimelineEvent { kind, category: category.into(), name: name.into(), start_ns, thread, args: Vec::new() }
    }

    #[cfg(feature = "io")]
    fn trace(timeline: &Timeline) -> String {
        let mut out = Vec::new();
        timeline.write_chrome_trace(&mut out).expect("writing to memory cannot fail");
        String::from_utf8(out).expect("JSON is UTF-8")
    }

    /// A hand-built timeline with fixed timestamps, written exactly: the file's shape is what the viewers read.
    #[cfg(feature = "io")]
    #[test]
    fn writes_the_chrome_trace_event_format() {
        let timeline = Timeline::enabled();
        timeline.name_thread(1, "main");
        timeline.name_thread(2, "group-offload-transformer");
        let mut onload = event(EventKind::Span { duration_ns: 250_500 }, category::ONLOAD, "text_encoder_1", 1_000, 1);
        onload.args = vec![("bytes".into(), 4096u64.into()), ("device".into(), "cuda:0".into())];
        let mut upload =
            event(EventKind::Span { duration_ns: 2_000 }, category::UPLOAD, "transformer/layers_1_1", 5_000, 2);
        upload.args = vec![("bytes".into(), 8000u64.into()), ("reason".into(), "prefetch".into())];
        let mut sample = event(EventKind::Counter, category::MEMORY, MEMORY_COUNTER, 251_500, 1);
        sample.args = vec![("allocated".into(), 4096u64.into()), ("available".into(), 1024u64.into())];
        // Pushed out of order: the file is sorted by start.
        timeline.push(event(EventKind::Span { duration_ns: 300_000 }, category::PHASE, "encode", 0, 1));
        timeline.push(upload);
        timeline.push(onload);
        timeline.push(sample);
        timeline.push(event(EventKind::Instant, category::PHASE, "release", 300_000, 1));
        expect![[r#"
            {"traceEvents":[
            {"args":{"name":"offload"},"name":"process_name","ph":"M","pid":1,"tid":0},
            {"args":{"name":"main"},"name":"thread_name","ph":"M","pid":1,"tid":1},
            {"args":{"name":"group-offload-transformer"},"name":"thread_name","ph":"M","pid":1,"tid":2},
            {"cat":"phase","dur":300.0,"name":"encode","ph":"X","pid":1,"tid":1,"ts":0.0},
            {"args":{"bytes":4096,"device":"cuda:0"},"cat":"onload","dur":250.5,"name":"text_encoder_1","ph":"X","pid":1,"tid":1,"ts":1.0},
            {"args":{"bytes":8000,"reason":"prefetch"},"cat":"upload","dur":2.0,"name":"transformer/layers_1_1","ph":"X","pid":1,"tid":2,"ts":5.0},
            {"args":{"MB/s":4000},"cat":"upload","name":"link rate","ph":"C","pid":1,"tid":2,"ts":7.0},
            {"args":{"allocated":4096,"available":1024},"cat":"memory","name":"device memory","ph":"C","pid":1,"tid":1,"ts":251.5},
            {"cat":"phase","name":"release","ph":"i","pid":1,"s":"t","tid":1,"ts":300.0}
            ],"displayTimeUnit":"ms","otherData":{"dropped_events":0}}
        "#]]
        .assert_eq(&trace(&timeline));
        let parsed: Value = serde_json::from_str(&trace(&timeline)).expect("valid JSON");
        // 8 kB in 2 µs: the link rate track's one sample, 4 GB/s, at the upload's end.
        assert_eq!(parsed["traceEvents"].as_array().map(Vec::len), Some(9));
    }

    struct Fixed;
    impl DeviceMemory for Fixed {
        fn device(&self) -> crate::DeviceName {
            crate::DeviceName::cpu()
        }
        fn total(&self) -> u64 {
            100
        }
        fn available(&self) -> u64 {
            60
        }
        fn allocated(&self) -> u64 {
            40
        }
        fn peak(&self) -> u64 {
            40
        }
    }

    /// Two devices sampled on one timeline: the first device's samples are the `device memory` track, the second
    /// device's a track of its own named after it, never mixed into the first.
    #[test]
    fn each_device_has_a_memory_track_of_its_own() {
        struct Card(&'static str, u64);
        impl DeviceMemory for Card {
            fn device(&self) -> crate::DeviceName {
                crate::DeviceName::parse(self.0).expect("a name")
            }
            fn total(&self) -> u64 {
                100
            }
            fn available(&self) -> u64 {
                100 - self.1
            }
            fn allocated(&self) -> u64 {
                self.1
            }
            fn peak(&self) -> u64 {
                self.1
            }
        }
        let timeline = Timeline::enabled();
        timeline.sample_memory(&Card("cuda:0", 10));
        timeline.sample_memory(&Card("cuda:1", 70));
        timeline.sample_memory(&Card("cuda:0", 20));
        let tracks = timeline.memory_tracks();
        let names: Vec<&str> = tracks.iter().map(|(name, _)| name.as_str()).collect();
        assert_eq!(names, ["device memory", "device memory cuda:1"]);
        let allocated = |track: usize| tracks[track].1.iter().map(|s| s.allocated).collect::<Vec<_>>();
        assert_eq!((allocated(0), allocated(1)), (vec![10, 20], vec![70]));
        assert_eq!(timeline.memory_samples(), tracks[0].1);
    }

    #[test]
    fn the_sampler_reads_memory_on_its_own_thread_until_dropped() {
        let timeline = Timeline::enabled();
        let sampler = timeline.sample_every(Arc::new(Fixed), Duration::from_millis(1));
        std::thread::sleep(Duration::from_millis(20));
        sampler.stop();
        let samples = timeline.memory_samples();
        assert!(samples.len() >= 2, "{samples:?}");
        assert!(samples.iter().all(|s| (s.allocated, s.available) == (40, 60)));
        let after = timeline.memory_samples().len();
        std::thread::sleep(Duration::from_millis(5));
        assert_eq!(timeline.memory_samples().len(), after, "the sampler stopped");
        assert_eq!(timeline.threads()[0].name, "memory sampler");
        // A disabled timeline starts no thread and samples nothing.
        let disabled = Timeline::disabled();
        disabled.sample_every(Arc::new(Fixed), Duration::from_millis(1)).stop();
        assert!(disabled.memory_samples().is_empty());
    }

    /// A category of the workspace, one of a caller's own, a short name and one past [`INLINE_LABEL`] all come
    /// back as they were given, with their args.
    #[test]
    fn names_and_categories_of_any_length_come_back_as_given() {
        let long = "transformer/layers_10_11/attention_and_feed_forward";
        assert!(long.len() > INLINE_LABEL);
        let timeline = Timeline::enabled();
        timeline.span(category::UPLOAD, long).arg("bytes", 4096u64).arg("reason", "prefetch").end();
        timeline.span("a category of my own", "vae_3").end();
        timeline.instant(category::PHASE, "é", &[("an arg whose key is longer than thirty bytes", 1u64.into())]);
        type Text = (String, String, Vec<(String, ArgValue)>);
        let texts: Vec<Text> = timeline.events().into_iter().map(|e| (e.category, e.name, e.args)).collect();
        assert_eq!(
            texts,
            vec![
                (
                    "upload".to_string(),
                    long.to_string(),
                    vec![("bytes".into(), ArgValue::Number(4096)), ("reason".into(), "prefetch".into())]
                ),
                ("a category of my own".to_string(), "vae_3".to_string(), vec![]),
                (
                    "phase".to_string(),
                    "é".to_string(),
                    vec![("an arg whose key is longer than thirty bytes".into(), ArgValue::Number(1))]
                ),
            ]
        );
    }

    #[test]
    fn spans_record_their_thread_and_a_disabled_timeline_nothing() {
        let timeline = Timeline::enabled();
        timeline.span(category::RUN, "vae_3").arg("bytes", 7u64).end();
        let worker = timeline.clone();
        std::thread::Builder::new()
            .name("worker".into())
            .spawn(move || worker.span(category::UPLOAD, "vae/g").end())
            .expect("a thread")
            .join()
            .expect("it ran");
        let events = timeline.events();
        assert_eq!(events.len(), 2);
        assert_eq!(events[0].arg("bytes"), Some(&ArgValue::Number(7)));
        assert_ne!(events[0].thread, events[1].thread);
        let names: Vec<String> = timeline.threads().into_iter().map(|t| t.name).collect();
        assert_eq!(names[1], "worker");

        let disabled = Timeline::disabled();
        disabled.span(category::RUN, "x").arg("bytes", 1u64).end();
        disabled.instant(category::PHASE, "x", &[]);
        assert!(disabled.events().is_empty() && disabled.now_ns().is_none());
        #[cfg(feature = "io")]
        assert!(trace(&disabled).contains("\"process_name\""));
    }
}
