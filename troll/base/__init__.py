"""What every command builds on: the settings (`config`, the presets), the command boundary (`cli`: one line and
exit 2 for a user's problem), and the files a run or a command writes and reads (`outputs`: only its own; `schema`;
`checkpoint`; `metrics`). Nothing here imports the rest of troll."""
