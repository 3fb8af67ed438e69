//! The BIOS: the system message the orchestrator writes at the top of the conversation before
//! every turn, telling the model its situation (docs/architecture.md, "The BIOS").

use std::fmt::Write;

use crate::llm::ToolDefinition;

/// What the BIOS describes.
#[derive(Debug)]
pub struct BiosContext<'a> {
    /// This turn (1-based).
    pub turn: u32,
    /// Most turns.
    pub max_turns: u32,
    /// Normal tools.
    pub normal_tools: &'a [ToolDefinition],
    /// Exit tools.
    pub exit_tools: &'a [ToolDefinition],
    /// Normal calls the run may still execute.
    pub budget_remaining: u32,
    /// Failing turns still tolerated.
    pub failures_remaining: u32,
}

/// Renders the BIOS for one turn.
pub fn render(ctx: &BiosContext<'_>) -> String {
    let mut s = String::with_capacity(1024);
    let _ = writeln!(
        s,
        "You are working inside an automated tool loop run by an orchestrator. This is turn {} of at most {}.",
        ctx.turn, ctx.max_turns
    );
    if ctx.normal_tools.is_empty() {
        s.push_str("\nNo normal tools are available in this run.\n");
    } else {
        s.push_str("\nNormal tools (each call is executed and its result comes back to you in the next turn; independent calls made in the same turn run in parallel):\n");
        for tool in ctx.normal_tools {
            let _ = writeln!(s, "- {}: {}", tool.name, tool.description);
        }
    }
    if !ctx.exit_tools.is_empty() {
        s.push_str("\nExit tools (one-way signals: calling one records it for the people and services watching this run; it is not executed, nothing comes back, and it costs no budget):\n");
        for tool in ctx.exit_tools {
            let _ = writeln!(s, "- {}: {}", tool.name, tool.description);
        }
    }
    let _ = writeln!(
        s,
        "\nTool-call budget: {} normal call(s) left in this run. If a turn asks for more than that, only the first {} run and the run ends.",
        ctx.budget_remaining, ctx.budget_remaining
    );
    let _ = writeln!(
        s,
        "Failure allowance: {} more turn(s) with a failing tool call are tolerated; a failed call's error comes back as its result so you can correct it.",
        ctx.failures_remaining
    );
    s.push_str(
        "\nIf you cannot make structured tool calls, write each call on its own as \
         <tool_call>{\"name\": \"TOOL\", \"arguments\": {...}}</tool_call>.\n\
         When the task is done, answer without calling a normal tool.",
    );
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn describes_turn_tools_budget_failures_and_the_fallback_convention() {
        let tool = |name: &str, description: &str| ToolDefinition {
            name: name.into(),
            description: description.into(),
            parameters: serde_json::json!({"type": "object"}).into(),
        };
        let normal = [tool("get_weather", "Current weather.")];
        let exit = [tool("submit_report", "Files the final report.")];
        let text = render(&BiosContext {
            turn: 2,
            max_turns: 8,
            normal_tools: &normal,
            exit_tools: &exit,
            budget_remaining: 5,
            failures_remaining: 1,
        });
        for expected in [
            "turn 2 of at most 8",
            "- get_weather: Current weather.",
            "- submit_report: Files the final report.",
            "5 normal call(s) left",
            "1 more turn(s)",
            "<tool_call>",
        ] {
            assert!(text.contains(expected), "{expected:?} missing from:\n{text}");
        }
    }
}
