//! `bench --fleet --quick`: the model fleet on two real llama-servers (`./scripts/test` installs
//! them), sticky against round robin, and the transcript's prefix replayed. It must measure both
//! sides and the replay; how fast they are is the report's business. What it asserts holds on
//! every CPU: every later turn reports its cached tokens, and a request that keeps the previous
//! one's prefix prefills fewer tokens than one whose first message changed.

use crate::common;

#[test]
fn the_fleet_benchmark_measures_both_sides_and_the_prefix() -> anyhow::Result<()> {
    let out = tempfile::tempdir()?;
    let output = common::run_bench(&["--fleet", "--quick"], out.path())?;
    anyhow::ensure!(
        output.status.success(),
        "bench failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let report: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(out.path().join("fleet.json"))?)?;
    for side in ["sticky", "round_robin"] {
        let side = &report[side];
        assert_eq!(
            (side["runs"].as_u64(), side["later_turns"].as_u64()),
            (Some(2), Some(4)),
            "{side}"
        );
        for field in [
            "prompt_tokens",
            "prefilled_tokens",
            "cached_share",
            "later_turn_ms",
            "run_ms",
        ] {
            assert!(side[field].is_number(), "{field} in {side}");
        }
    }
    assert!(
        report["sticky"]["cached_share"].as_f64().unwrap_or(0.0) > 0.0,
        "{report}"
    );
    let replay = &report["replay"];
    let kept: Vec<u64> = serde_json::from_value(replay["prefix_kept"].clone())?;
    let changed: Vec<u64> = serde_json::from_value(replay["bios_per_turn"].clone())?;
    assert_eq!((kept.len(), changed.len()), (2, 2), "{replay}");
    assert!(kept.iter().zip(&changed).all(|(k, c)| k < c), "{replay}");
    let markdown = std::fs::read_to_string(out.path().join("fleet.md"))?;
    assert!(markdown.contains("Sticky ÷ round robin"), "{markdown}");
    Ok(())
}
