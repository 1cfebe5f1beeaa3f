// The requests the page starts from: each a state and its questions, as the form shows them.
export const EXAMPLES = [
  {
    name: "Support ticket",
    state: { kind: "text", value: "My order arrived broken and nobody answers my emails. I want my money back today." },
    questions: [
      { id: "complaint", type: "noul", instructions: "Is the customer complaining?" },
      {
        id: "intent", type: "choice", instructions: "What does the customer want?",
        options: [["refund", "Money back"], ["replacement", "A new item"], ["information", ""]],
      },
      { id: "urgency", type: "score", instructions: "How urgent is it?", levels: ["low", "medium", "high"] },
    ],
  },
  {
    name: "Product review (JSON state)",
    state: { kind: "json", value: '{\n  "product": "kettle",\n  "stars": 2,\n  "review": "Boils fast but the lid broke in a week."\n}' },
    questions: [
      { id: "sentiment", type: "choice", instructions: "", options: [["positive", ""], ["mixed", ""], ["negative", ""]] },
      { id: "quality_issue", type: "noul", instructions: "Does the review report a defect?", truthy: "A part broke or failed" },
      { id: "recommend", type: "score", instructions: "Would the reviewer recommend it?", levels: ["no", "maybe", "yes"] },
    ],
  },
  {
    name: "Routing a message",
    state: { kind: "text", value: "Hi, can you move my 3pm meeting with Dana to Thursday?" },
    questions: [
      {
        id: "team", type: "choice", instructions: "Which assistant should handle this?",
        options: [["calendar", "Meetings and events"], ["email", "Writing and sending mail"], ["other", ""]],
      },
    ],
  },
];
