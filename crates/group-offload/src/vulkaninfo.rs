//! A Vulkan heap's budget (`VK_EXT_memory_budget`) read from `vulkaninfo --text`, the Vulkan SDK's and Debian's
//! (`vulkan-tools`) report of every physical device.
//!
//! No safe Rust binding reads the budget: vulkano 0.35 does not, wgpu 30 reads it only inside wgpu-hal, and
//! calling Vulkan ourselves needs `unsafe`, which the workspace forbids. `vulkaninfo` runs as a process of its
//! own, so the budget it prints is what a new process may allocate from each heap at that moment: the heap's size
//! less what other processes hold on it (the extension's budget, "a rough estimate of how much memory the process
//! can allocate from that heap"), and its `usage` is its own, about zero. Read when the device opens, before this
//! process allocates, it is this process's room on the device.
//!
//! `vulkaninfo` prints `budget` and `usage` under each of a device's `memoryHeaps[i]` only when the driver offers
//! the extension (Vulkan-Tools' `GpuDumpMemoryProps`; older versions printed them always, zero when the
//! extension was absent, and the extension's own rule is that a heap's budget is never zero, so zero is no
//! budget). Lavapipe does not offer it: its report lists a heap's size and flags only
//! (`tests/fixtures/vulkaninfo-lavapipe.txt`, saved from this project's CI machine).
//!
//! [`parse`] and [`device_local_budget`] are pure functions of the report's text that never panic, whatever the
//! text (the fuzz target's entry point is [`parse`]); [`run`] is the one place `vulkaninfo` is started, under a
//! deadline ([`TIMEOUT`]), so a driver that hangs it cannot hang the device's open.

use std::io::Read;
use std::time::{Duration, Instant};

/// How long `vulkaninfo` may take before it is stopped: a healthy driver answers in well under a second (measured on
/// lavapipe: 0.04 to 0.26 s for `--text`, 57 KB), and a device's open waits for it, so a hung driver costs the open this long
/// once, and the budget is then unknown (the heap is the total).
pub const TIMEOUT: Duration = Duration::from_secs(5);

/// Runs `program --text` (`vulkaninfo`, found on `PATH`) and returns its report, or why there is none, in words for
/// the budget's explanation: it could not start (with the package that provides it), it did not answer within
/// `timeout` (it is then killed, and the report is not waited for), it failed, or its report could not be read.
///
/// The report is read on a thread of its own while the process runs, so a report larger than the pipe's buffer
/// cannot stall it. A child that `program` left behind holding the pipe (a shell script's `sleep`) keeps that thread
/// until it exits, never the caller.
pub fn run(program: &std::ffi::OsStr, timeout: Duration) -> Result<String, String> {
    let started = Instant::now();
    let mut child = std::process::Command::new(program)
        .arg("--text")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .map_err(|error| format!("vulkaninfo could not run ({error}; Debian: `apt-get install vulkan-tools`)"))?;
    let stopped = |child: &mut std::process::Child, why: String| {
        // Killing a process that has just exited fails harmlessly; the wait reaps it either way.
        let _ = child.kill();
        let _ = child.wait();
        why
    };
    let Some(mut stdout) = child.stdout.take() else {
        return Err(stopped(&mut child, "vulkaninfo's output could not be read (no pipe)".into()));
    };
    let (sender, report) = std::sync::mpsc::channel();
    let reader = std::thread::Builder::new().name("vulkaninfo-report".into()).spawn(move || {
        let mut bytes = Vec::new();
        let _ = sender.send(stdout.read_to_end(&mut bytes).map(|_| bytes));
    });
    if let Err(error) = reader {
        return Err(stopped(&mut child, format!("cannot start a thread to read vulkaninfo's report ({error})")));
    }
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) if started.elapsed() >= timeout => {
                return Err(stopped(
                    &mut child,
                    format!(
                        "vulkaninfo did not answer within {} and was stopped (a hung Vulkan driver? `vulkaninfo \
                         --summary` shows whether it answers)",
                        seconds(timeout)
                    ),
                ));
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(10)),
            Err(error) => return Err(stopped(&mut child, format!("vulkaninfo could not be waited for ({error})"))),
        }
    };
    if !status.success() {
        return Err(format!("vulkaninfo failed ({status})"));
    }
    // The report ends when the pipe closes, at once unless something vulkaninfo started still holds it.
    match report.recv_timeout(timeout.saturating_sub(started.elapsed())) {
        Ok(Ok(bytes)) => Ok(String::from_utf8_lossy(&bytes).into_owned()),
        Ok(Err(error)) => Err(format!("vulkaninfo's report could not be read ({error})")),
        Err(_) => Err(format!("vulkaninfo exited but its report did not end within {}", seconds(timeout))),
    }
}

/// A deadline in words: `5 s`, `0.25 s`.
fn seconds(duration: Duration) -> String {
    format!("{} s", duration.as_secs_f64())
}

/// One memory heap of a device as `vulkaninfo` prints it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Heap {
    /// The heap's size in bytes.
    pub size: u64,
    /// What a process may allocate from it, where the driver offers `VK_EXT_memory_budget` (never zero).
    pub budget: Option<u64>,
    /// What the printing process itself used of it, where the driver offers the extension.
    pub usage: Option<u64>,
    /// Whether the heap is flagged `MEMORY_HEAP_DEVICE_LOCAL_BIT`.
    pub device_local: bool,
}

/// One physical device of a `vulkaninfo` report.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Gpu {
    /// `vendorID`, as wgpu's `AdapterInfo::vendor`.
    pub vendor: u32,
    /// `deviceID`, as wgpu's `AdapterInfo::device`.
    pub device: u32,
    /// `deviceName`, as wgpu's `AdapterInfo::name`.
    pub name: String,
    /// Its memory heaps, in the driver's order.
    pub heaps: Vec<Heap>,
}

impl Gpu {
    /// The largest device-local heap (the device's memory, as [`crate::device`] takes it), if any.
    pub fn largest_device_local(&self) -> Option<&Heap> {
        self.heaps.iter().filter(|heap| heap.device_local).max_by_key(|heap| heap.size)
    }
}

/// Every physical device of a `vulkaninfo --text` report, in its order (`GPU0:`, `GPU1:`, ...). A device whose
/// ids could not be read is left out; lines this reader does not know are skipped.
pub fn parse(report: &str) -> Vec<Gpu> {
    let mut gpus = Vec::new();
    let mut current: Option<Gpu> = None;
    // Whether the lines read belong to a memory heap (from `memoryHeaps[i]:` to the next heap or `memoryTypes`).
    let mut in_heap = false;
    for line in report.lines() {
        let trimmed = line.trim();
        if is_gpu_header(trimmed) {
            gpus.extend(current.take());
            current = Some(Gpu { vendor: u32::MAX, device: u32::MAX, name: String::new(), heaps: Vec::new() });
            in_heap = false;
            continue;
        }
        let Some(gpu) = current.as_mut() else { continue };
        if trimmed.starts_with("memoryHeaps[") {
            gpu.heaps.push(Heap { size: 0, budget: None, usage: None, device_local: false });
            in_heap = true;
            continue;
        }
        if trimmed.starts_with("memoryTypes") {
            in_heap = false;
            continue;
        }
        if let Some(heap) = gpu.heaps.last_mut().filter(|_| in_heap) {
            match key_value(trimmed) {
                Some(("size", value)) => heap.size = leading_number(value).unwrap_or(0),
                Some(("budget", value)) => heap.budget = leading_number(value).filter(|&budget| budget > 0),
                Some(("usage", value)) => heap.usage = leading_number(value),
                _ if trimmed == "MEMORY_HEAP_DEVICE_LOCAL_BIT" => heap.device_local = true,
                _ => {}
            }
            continue;
        }
        // The first of each: later sections (drivers, layers) may repeat a key.
        match key_value(trimmed) {
            Some(("vendorID", value)) if gpu.vendor == u32::MAX => gpu.vendor = hex(value).unwrap_or(u32::MAX),
            Some(("deviceID", value)) if gpu.device == u32::MAX => gpu.device = hex(value).unwrap_or(u32::MAX),
            Some(("deviceName", value)) if gpu.name.is_empty() => gpu.name = value.to_string(),
            _ => {}
        }
    }
    gpus.extend(current);
    gpus.retain(|gpu| gpu.vendor != u32::MAX && gpu.device != u32::MAX);
    gpus
}

/// The budget of the largest device-local heap of the device with `vendor` and `device` ids (and `name` where
/// several share them) in `report`, or why there is none, in words for [`crate::Error::UnknownTotal`]'s
/// neighbours: no such device, no device-local heap, or a driver without `VK_EXT_memory_budget`.
pub fn device_local_budget(report: &str, vendor: u32, device: u32, name: &str) -> Result<u64, String> {
    let gpus = parse(report);
    let matching: Vec<&Gpu> = gpus.iter().filter(|gpu| gpu.vendor == vendor && gpu.device == device).collect();
    let gpu = match matching.as_slice() {
        [one] => *one,
        [] => return Err(format!("vulkaninfo lists no device with the adapter's ids ({vendor:#x}:{device:#x})")),
        several => several.iter().copied().find(|gpu| gpu.name == name).ok_or_else(|| {
            format!("vulkaninfo lists {} devices with the adapter's ids and none is named {name:?}", several.len())
        })?,
    };
    let heap = gpu
        .largest_device_local()
        .ok_or_else(|| format!("vulkaninfo lists no device-local heap for {:?}", gpu.name))?;
    heap.budget.ok_or_else(|| {
        format!(
            "the driver of {:?} does not offer VK_EXT_memory_budget (vulkaninfo prints no budget for its device-local \
             heap)",
            gpu.name
        )
    })
}

fn is_gpu_header(line: &str) -> bool {
    line.strip_prefix("GPU")
        .and_then(|rest| rest.strip_suffix(':'))
        .is_some_and(|index| !index.is_empty() && index.bytes().all(|b| b.is_ascii_digit()))
}

/// `key = value` with any spacing around `=`.
fn key_value(line: &str) -> Option<(&str, &str)> {
    let (key, value) = line.split_once('=')?;
    Some((key.trim(), value.trim()))
}

/// The decimal number a value starts with: `2147483648 (0x80000000) (2.00 GiB)` gives 2147483648.
fn leading_number(value: &str) -> Option<u64> {
    value.split_whitespace().next()?.parse().ok()
}

/// A `0x`-prefixed hexadecimal id.
fn hex(value: &str) -> Option<u32> {
    u32::from_str_radix(value.split_whitespace().next()?.strip_prefix("0x")?, 16).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    const LAVAPIPE: &str = include_str!("../tests/fixtures/vulkaninfo-lavapipe.txt");

    #[test]
    fn lavapipe_lists_its_one_heap_and_no_budget() {
        let gpus = parse(LAVAPIPE);
        assert_eq!(gpus.len(), 1, "{gpus:?}");
        let gpu = &gpus[0];
        assert_eq!((gpu.vendor, gpu.device), (0x10005, 0));
        assert_eq!(gpu.name, "llvmpipe (LLVM 15.0.6, 256 bits)");
        assert_eq!(gpu.heaps, vec![Heap { size: 2 << 30, budget: None, usage: None, device_local: true }]);
        let why = device_local_budget(LAVAPIPE, 0x10005, 0, &gpu.name).unwrap_err();
        assert!(why.contains("does not offer VK_EXT_memory_budget"), "{why}");
    }

    /// A discrete card as `vulkaninfo` prints one whose driver offers the extension (Vulkan-Tools'
    /// `GpuDumpMemoryProps`: `size`, `budget` and `usage` with a key width of 6, each as decimal, hex and
    /// human-readable), with a small host-visible window listed first and a second device of the same ids. No
    /// driver here offers the extension, so this report is written in that format, not saved from a run.
    const DISCRETE: &str = "\
GPU0:
VkPhysicalDeviceProperties:
---------------------------
\tvendorID          = 0x10de
\tdeviceID          = 0x2684
\tdeviceName        = NVIDIA GeForce RTX 4090
VkPhysicalDeviceMemoryProperties:
=================================
memoryHeaps: count = 2
\tmemoryHeaps[0]:
\t\tsize   = 257949696 (0x0f600000) (246.00 MiB)
\t\tbudget = 257949696 (0x0f600000) (246.00 MiB)
\t\tusage  = 0 (0x00000000) (0.00 B)
\t\tflags: count = 1
\t\t\tMEMORY_HEAP_DEVICE_LOCAL_BIT
\tmemoryHeaps[1]:
\t\tsize   = 25757220864 (0x5ff400000) (23.99 GiB)
\t\tbudget = 23622320128 (0x580000000) (22.00 GiB)
\t\tusage  = 0 (0x00000000) (0.00 B)
\t\tflags: count = 1
\t\t\tMEMORY_HEAP_DEVICE_LOCAL_BIT
memoryTypes: count = 1
\tmemoryTypes[0]:
\t\theapIndex     = 1
GPU1:
VkPhysicalDeviceProperties:
---------------------------
\tvendorID          = 0x10de
\tdeviceID          = 0x2684
\tdeviceName        = NVIDIA GeForce RTX 4090 (second)
VkPhysicalDeviceMemoryProperties:
=================================
memoryHeaps: count = 1
\tmemoryHeaps[0]:
\t\tsize   = 25757220864 (0x5ff400000) (23.99 GiB)
\t\tbudget = 0 (0x00000000) (0.00 B)
\t\tusage  = 0 (0x00000000) (0.00 B)
\t\tflags: count = 1
\t\t\tMEMORY_HEAP_DEVICE_LOCAL_BIT
";

    #[test]
    fn the_largest_device_local_heaps_budget_of_the_named_device() {
        assert_eq!(device_local_budget(DISCRETE, 0x10de, 0x2684, "NVIDIA GeForce RTX 4090"), Ok(22 << 30));
        // A zero budget is no budget (the extension never reports one): older vulkaninfo prints zeros without it.
        let why = device_local_budget(DISCRETE, 0x10de, 0x2684, "NVIDIA GeForce RTX 4090 (second)").unwrap_err();
        assert!(why.contains("does not offer VK_EXT_memory_budget"), "{why}");
        let why = device_local_budget(DISCRETE, 0x10de, 0x2684, "another").unwrap_err();
        assert!(why.contains("2 devices") && why.contains("\"another\""), "{why}");
        let why = device_local_budget(DISCRETE, 0x1002, 0x744c, "").unwrap_err();
        assert!(why.contains("0x1002:0x744c"), "{why}");
    }

    /// A small deterministic generator (xorshift64*), so a failing mutation can be replayed from its round.
    struct Mutations(u64);

    impl Mutations {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
        }

        fn below(&mut self, n: usize) -> usize {
            (self.next() % n.max(1) as u64) as usize
        }
    }

    /// Fragments of the report's own grammar, so that mutations reach the parser's branches, not only its skip path.
    const FRAGMENTS: [&str; 16] = [
        "GPU0:\n",
        "GPU18446744073709551616:\n",
        "\tmemoryHeaps[0]:\n",
        "memoryTypes: count = 1\n",
        "\t\tsize   = 18446744073709551616 (0x0) (16 EiB)\n",
        "\t\tbudget = 0\n",
        "\t\tbudget = -1\n",
        "\t\tusage  = \n",
        "MEMORY_HEAP_DEVICE_LOCAL_BIT\n",
        "\tvendorID = 0x\n",
        "\tvendorID = 0xffffffffff\n",
        "\tdeviceID = 0x10005\n",
        "\tdeviceName = \u{e9}\u{1f600}\n",
        "=",
        "\r\n",
        "\u{0}",
    ];

    /// One mutation of `text`: a cut, a deleted or repeated span, a fragment inserted, or a byte's character replaced,
    /// always at character boundaries (the parser takes text).
    fn mutate(text: &str, random: &mut Mutations) -> String {
        let boundaries: Vec<usize> = text.char_indices().map(|(i, _)| i).chain([text.len()]).collect();
        let at = |random: &mut Mutations| boundaries[random.below(boundaries.len())];
        let (a, b) = {
            let (x, y) = (at(random), at(random));
            (x.min(y), x.max(y))
        };
        match random.below(5) {
            0 => text[..a].to_string(),
            1 => format!("{}{}", &text[..a], &text[b..]),
            2 => format!("{}{}{}", &text[..b], &text[a..b], &text[b..]),
            3 => format!("{}{}{}", &text[..a], FRAGMENTS[random.below(FRAGMENTS.len())], &text[a..]),
            _ => {
                let replacement = char::from_u32(random.below(0x3000) as u32).unwrap_or('\u{fffd}');
                let end = text[a..].chars().next().map_or(a, |c| a + c.len_utf8());
                format!("{}{replacement}{}", &text[..a], &text[end..])
            }
        }
    }

    /// The parser is a pure function of the text that never panics: 20,000 mutated reports (each built from the
    /// last, restarting from a real report every 50 rounds), and the same text always reads the same.
    #[test]
    fn any_mutation_of_a_report_parses_without_panicking_and_the_same_text_reads_the_same() {
        let seeds = [LAVAPIPE, DISCRETE];
        let mut random = Mutations(0x9e37_79b9_7f4a_7c15);
        let mut text = String::new();
        for round in 0..20_000 {
            if round % 50 == 0 {
                text = seeds[random.below(seeds.len())].to_string();
            }
            text = mutate(&text, &mut random);
            let gpus = parse(&text);
            assert_eq!(gpus, parse(&text), "round {round}: the same text read differently");
            for gpu in &gpus {
                assert!(gpu.vendor != u32::MAX && gpu.device != u32::MAX, "round {round}: a device without ids");
                let _ = device_local_budget(&text, gpu.vendor, gpu.device, &gpu.name);
            }
            let _ = device_local_budget(&text, 0x10005, 0, "llvmpipe (LLVM 15.0.6, 256 bits)");
        }
    }

    #[test]
    fn anything_else_reads_as_no_device() {
        assert!(parse("").is_empty());
        assert!(parse("vulkaninfo: command failed\nERROR: [Loader Message] no ICD").is_empty());
        // A device without ids is left out; a heap without a size reads as 0, never as another heap's size.
        assert!(parse("GPU0:\n\tdeviceName = x\n").is_empty());
        let gpus = parse("GPU7:\n\tvendorID = 0x1\n\tdeviceID = 0x2\n\tmemoryHeaps[0]:\n\t\tflags: count = 0\n");
        assert_eq!(gpus[0].heaps, vec![Heap { size: 0, budget: None, usage: None, device_local: false }]);
        assert_eq!(gpus[0].largest_device_local(), None);
    }
}
