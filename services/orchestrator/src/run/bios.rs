//! The BIOS and the status notes: what the orchestrator tells the model about its situation
//! (docs/architecture.md, "The BIOS").
//!
//! A model server keeps the prompt of a run's last request in its prefix cache, so each turn's
//! request starts with the previous one byte for byte: the BIOS, the first message, holds only
//! what is fixed for the run (its tools, its limits, the fallback convention), and what changes
//! per turn (the turn, the budget and failures left) is a status note placed after the newest
//! messages when a turn ends, where it then stays.

use std::fmt::Write;

use crate::domain::chat::STATUS_MARK;
use crate::domain::chat::{Message, ToolDefinition};

/// What the BIOS describes: fixed for the whole run.
#[derive(Debug)]
pub struct BiosContext<'a> {
    /// Most turns.
    pub max_turns: u32,
    /// Normal tools.
    pub normal_tools: &'a [ToolDefinition],
    /// Exit tools.
    pub exit_tools: &'a [ToolDefinition],
    /// Normal calls the run may execute in all.
    pub tool_call_budget: u32,
    /// Failing turns tolerated in all.
    pub max_tool_failures: u32,
}

/// What a status note says: the state of the run as the next turn starts.
#[derive(Debug, Clone, Copy)]
pub struct Status {
    /// The turn about to start (1-based).
    pub turn: u32,
    /// Most turns.
    pub max_turns: u32,
    /// Normal calls the run may still execute.
    pub budget_remaining: u32,
    /// Failing turns still tolerated.
    pub failures_remaining: u32,
}

/// Renders the BIOS of a run.
pub fn render(ctx: &BiosContext<'_>) -> String {
    let mut s = String::with_capacity(1024);
    let _ = writeln!(
        s,
        "You are working inside an automated tool loop run by an orchestrator. The run starts at turn 1 of at most {}.",
        ctx.max_turns
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
        "\nTool-call budget: {} normal call(s) in this run. If a turn asks for more than are left, only the first ones run and the run ends.",
        ctx.tool_call_budget
    );
    let _ = writeln!(
        s,
        "Failure allowance: {} turn(s) with a failing tool call are tolerated; a failed call's error comes back as its result so you can correct it.",
        ctx.max_tool_failures
    );
    let _ = writeln!(
        s,
        "After the results of each turn's tool calls, a message starting {STATUS_MARK} says which turn begins, how many normal calls are left and how many more failing turns are tolerated."
    );
    s.push_str(
        "\nIf you cannot make structured tool calls, write each call on its own as \
         <tool_call>{\"name\": \"TOOL\", \"arguments\": {...}}</tool_call>.\n\
         When the task is done, answer without calling a normal tool.",
    );
    s
}

/// The text of a status note.
pub fn status_note(status: Status) -> String {
    format!(
        "{STATUS_MARK} Turn {} of at most {} begins. Tool-call budget: {} normal call(s) left; if a turn asks for more, only the first {} run and the run ends. Failure allowance: {} more turn(s) with a failing tool call are tolerated.",
        status.turn, status.max_turns, status.budget_remaining, status.budget_remaining, status.failures_remaining
    )
}

/// Puts `note` after the newest message of `conversation` as a user message (see
/// [`append_user`](crate::domain::chat::append_user): a paragraph of the newest message when it
/// is one already; many templates also refuse a system message after the first).
pub fn append_note(conversation: &mut Vec<Message>, note: String) {
    crate::domain::chat::append_user(conversation, &note, None);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tool(name: &str, description: &str) -> ToolDefinition {
        ToolDefinition {
            name: name.into(),
            description: description.into(),
            parameters: serde_json::json!({"type": "object"}).into(),
        }
    }

    #[test]
    fn describes_turns_tools_budget_failures_the_notes_and_the_fallback_convention() {
        let normal = [tool("get_weather", "Current weather.")];
        let exit = [tool("submit_report", "Files the final report.")];
        let text = render(&BiosContext {
            max_turns: 8,
            normal_tools: &normal,
            exit_tools: &exit,
            tool_call_budget: 5,
            max_tool_failures: 1,
        });
        for expected in [
            "turn 1 of at most 8",
            "- get_weather: Current weather.",
            "- submit_report: Files the final report.",
            "5 normal call(s) in this run",
            "1 turn(s) with a failing tool call",
            STATUS_MARK,
            "<tool_call>",
        ] {
            assert!(text.contains(expected), "{expected:?} missing from:\n{text}");
        }
    }

    #[test]
    fn a_status_note_gives_the_turn_the_budget_and_the_failures_left() {
        let note = status_note(Status {
            turn: 3,
            max_turns: 8,
            budget_remaining: 4,
            failures_remaining: 0,
        });
        for expected in [
            STATUS_MARK,
            "Turn 3 of at most 8",
            "4 normal call(s) left",
            "0 more turn(s)",
        ] {
            assert!(note.contains(expected), "{expected:?} missing from:\n{note}");
        }
    }

    #[test]
    fn a_note_follows_tool_messages_as_a_user_message_and_joins_a_user_message() {
        let mut conversation = vec![Message::Tool {
            tool_call_id: "c1".into(),
            content: "{}".into(),
        }];
        append_note(&mut conversation, "note 1".into());
        assert_eq!(
            conversation.last(),
            Some(&Message::User {
                content: "note 1".into(),
                name: None
            })
        );
        append_note(&mut conversation, "note 2".into());
        assert_eq!(conversation.len(), 2, "no two user messages in a row");
        assert_eq!(
            conversation.last(),
            Some(&Message::User {
                content: "note 1\n\nnote 2".into(),
                name: None
            })
        );
    }
}
