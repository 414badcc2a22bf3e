//! Parsing of the quantities users type: token counts (`16K`, `1024`) and byte sizes (`8G`, `512M`, `1.5G`),
//! and machine profiles by name or path (and what a profile lacks for the models at hand). Suffixes are binary: K = 1024, M = 2^20, G = 2^30 (a budget of "8G" is
//! 8 GiB, like the paper's `-mva` MiB values).

use std::path::Path;

use anyhow::{Context, bail};
use pipeshard_core::cost::{Device, TableCostModel};
use pipeshard_core::dtype::DType;
use pipeshard_core::inventory::Inventory;
use pipeshard_core::model::ModelSpec;
use pipeshard_core::profile::Profile;
use pipeshard_core::reference;

/// A number with an optional binary suffix (K, M, G, T; case-insensitive, an optional trailing `B` or `iB`).
fn parse_scaled(s: &str, what: &str) -> anyhow::Result<u64> {
    let t = s.trim();
    let t = t.strip_suffix("iB").or_else(|| t.strip_suffix('B')).unwrap_or(t);
    let (num, scale) = match t.char_indices().last() {
        Some((i, c)) if c.is_ascii_alphabetic() => {
            let scale: u64 = match c.to_ascii_uppercase() {
                'K' => 1 << 10,
                'M' => 1 << 20,
                'G' => 1 << 30,
                'T' => 1 << 40,
                _ => bail!("{what} `{s}`: unknown suffix `{c}`; use K, M, G or T (binary)"),
            };
            (&t[..i], scale)
        }
        _ => (t, 1),
    };
    let x: f64 = num
        .trim()
        .parse()
        .with_context(|| format!("{what} `{s}` is not a number with an optional K/M/G/T suffix"))?;
    if !x.is_finite() || x < 0.0 {
        bail!("{what} `{s}` must be a non-negative number");
    }
    let v = x * scale as f64;
    // `as u64` saturates: "1e30G" would silently become 2^64 − 1.
    if v >= u64::MAX as f64 {
        bail!("{what} `{s}` does not fit in 64 bits");
    }
    if v.fract() != 0.0 {
        bail!("{what} `{s}` is not a whole number of units ({v})");
    }
    Ok(v as u64)
}

/// Tokens: `16K` = 16384, `1024`, `0.5K` = 512.
pub fn parse_tokens(s: &str) -> anyhow::Result<u64> {
    parse_scaled(s, "token count")
}

/// Bytes: `8G` = 8 GiB, `512M`, `1.5G`, `4096`.
pub fn parse_bytes(s: &str) -> anyhow::Result<u64> {
    parse_scaled(s, "size")
}

/// Bytes as the shortest of `NG`, `NM`, `NK` or `N` that is exact (`8G`, `1536M`).
#[must_use]
pub fn format_bytes(b: u64) -> String {
    for (unit, scale) in [("T", 1u64 << 40), ("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)] {
        if b >= scale && b.is_multiple_of(scale) {
            return format!("{}{unit}", b / scale);
        }
    }
    b.to_string()
}

/// Tokens as `NK` when a whole multiple of 1024 (`16K`), else the number.
#[must_use]
pub fn format_tokens(t: u64) -> String {
    if t >= 1024 && t.is_multiple_of(1024) { format!("{}K", t / 1024) } else { t.to_string() }
}

/// A machine profile: a JSON file path, `profiles/NAME.json`, or the derived reference profile `NAME`
/// (cli1, cli2, cli3).
pub fn load_profile(name: &str) -> anyhow::Result<Profile> {
    let path = Path::new(name);
    if path.extension().is_some_and(|e| e == "json") || path.is_file() {
        return Profile::load(path).with_context(|| format!("loading profile {name}"));
    }
    let committed = Path::new("profiles").join(format!("{name}.json"));
    if committed.is_file() {
        return Profile::load(&committed).with_context(|| format!("loading profile {}", committed.display()));
    }
    reference::derived(name).with_context(|| {
        format!(
            "no profile `{name}`: not a file, not profiles/{name}.json, and not a derived system ({})",
            reference::systems().join(", ")
        )
    })
}

/// One warning per (format, device) in which `cost` prices some of `specs`' matrices from the bf16 rows: a
/// measured profile without rows of that quantised format there ([`TableCostModel::borrows_bf16`]).
pub fn borrowed_rows<'a>(
    cost: &TableCostModel,
    profile_name: &str,
    specs: impl IntoIterator<Item = &'a ModelSpec>,
) -> Vec<String> {
    let mut dtypes: Vec<DType> = specs
        .into_iter()
        .flat_map(|s| Inventory::new(s).tensors.into_iter().filter(|t| t.shape.len() > 1).map(|t| t.dtype))
        .collect();
    dtypes.sort_unstable();
    dtypes.dedup();
    let mut v = Vec::new();
    for d in dtypes {
        for (device, name) in [(Device::Gpu, "GPU"), (Device::Cpu, "CPU")] {
            if cost.borrows_bf16(device, d) {
                v.push(format!(
                    "warning: profile {profile_name} has no {d} rows on the {name}: {d} matmuls there are priced at \
                     the bf16 rows' efficiency over their own bytes (re-run `pipeshard profile measure` to \
                     measure them)",
                    d = d.name()
                ));
            }
        }
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_and_tokens() {
        assert_eq!(parse_tokens("16K").unwrap(), 16_384);
        assert_eq!(parse_tokens("1024").unwrap(), 1024);
        assert_eq!(parse_tokens("0.5k").unwrap(), 512);
        assert_eq!(parse_bytes("8G").unwrap(), 8 << 30);
        assert_eq!(parse_bytes("1.5GiB").unwrap(), 3 << 29);
        assert_eq!(parse_bytes("512MB").unwrap(), 512 << 20);
        assert!(parse_bytes("8X").unwrap_err().to_string().contains("suffix"));
        assert!(parse_tokens("1.3").unwrap_err().to_string().contains("whole"));
        assert!(parse_bytes("-1G").is_err());
        // Found reading the experiment reader for its fuzz target: this used to saturate to 2^64 − 1 silently.
        assert!(parse_bytes("1e30G").unwrap_err().to_string().contains("64 bits"));
        assert_eq!(format_bytes(8 << 30), "8G");
        assert_eq!(format_bytes(1536 << 20), "1536M");
        assert_eq!(format_bytes(1000), "1000");
        assert_eq!(format_tokens(65_536), "64K");
        assert_eq!(format_tokens(1000), "1000");
    }

    #[test]
    fn profiles_by_name() {
        assert_eq!(load_profile("cli3").unwrap().machine.name, "cli3");
        assert!(load_profile("nope").unwrap_err().to_string().contains("cli1"));
    }
}
